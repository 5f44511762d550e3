from research.experiments import common
from research.experiments.width_ladder import Config, main

common.cli(main, Config)
