"""The end-to-end demo: prepare kanji, train, evaluate, index, evaluate refinements, launch the app."""
