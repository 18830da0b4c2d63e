"""FAISS indices searched under a refined metric matrix M′; `python -m index --help`."""
