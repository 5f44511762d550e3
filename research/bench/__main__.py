from research.bench.cli import main

main()
