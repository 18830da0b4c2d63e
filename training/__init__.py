"""Data sets, losses, regularizers and the training loop; `python -m training --help`."""
