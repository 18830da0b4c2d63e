"""The one evaluator, shared by training, index and app.

Retrieval metrics follow the deep-metric-learning literature as
pytorch-metric-learning's AccuracyCalculator documents them (MAP@R,
R-Precision, Precision@1), plus Recall@K and k-means NMI / pairwise F1.
"""
from .evaluator import evaluate, evaluate_ranking
from .knn import knn_search

__all__ = ["evaluate", "evaluate_ranking", "knn_search"]
