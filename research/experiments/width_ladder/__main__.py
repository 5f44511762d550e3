from research.experiments import common
from research.experiments.width_ladder import Config, main
from research.experiments.width_ladder.ledger import kept

common.cli(main, Config, kept=kept)
