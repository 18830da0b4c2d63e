import logging
import sys


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "matplotlib", "PIL", "faiss"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
