"""One light module per drafter type, each declaring that type's ``SPEC`` (:class:`drafter_node.spec.DrafterSpec`).

The config loader imports all of them (``drafter_node/types.py`` names them), so they import nothing heavy at
module scope: the implementing class is named by ``module:Class`` and imported only when a drafter is built, and a
hook imports what it needs (the type's own checks, transformers) when it runs.
"""
