"""The engramrt lab: the tiny Engram LM (:mod:`engramrt_lab.models`), its training
(:mod:`engramrt_lab.training`) and the demo (``engramrt demo``, :mod:`engramrt_lab.cli`).

It uses the product, ``engramrt``; the product never imports it. The shipped model's
weights are this package's data (``engramrt_lab/data/tiny-lm``).
"""
