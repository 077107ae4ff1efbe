"""Evaluating a pretrained captioner (docs/design.md §9): linear probes, zero-shot classification by caption
scoring, vision–language compositionality (ARO, SugarCrepe) and caption quality (BLEU-4, CIDEr-D).

Plain PyTorch, numpy and scikit-learn: every function runs in one process. The Ray batch-inference
path for large datasets is `pipelines/run/feature_extraction.py`, the `mdc eval` commands `pipelines/cli/evaluate.py`.
"""
