"""One module per `jobs/benchmark.py` subcommand; each exposes `main(argv) -> dict`."""
