import tyro

from research.experiments.scalability import Config, main

main(tyro.cli(Config))
