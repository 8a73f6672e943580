"""Entry points only: argparse -> a config dataclass -> library calls."""
