from research.experiments import common
from research.experiments.scalability import Config, main

common.cli(main, Config)
