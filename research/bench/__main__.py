from research import entry
from research.bench.cli import main

entry.command(main, interrupted="a long benchmark's --out keeps the sections it finished")
