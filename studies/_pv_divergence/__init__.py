"""The parts of the ``pv-divergence`` study (studies/pv_divergence.py): the model (`gpt`), the
data (`corpora`), the arms (`arms`), one training run (`training`), what it measures
(`probes`), the report (`report`) and the published records it is held against
(``published.json``, read by `report`).

The folder's name starts with an underscore so that the study framework does not take it for
a study; pv_divergence.py loads it as a package from its path.
"""
