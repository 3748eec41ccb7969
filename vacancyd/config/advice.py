"""Advice on a configuration that is valid but probably not what its owner wants.

``vacancyd check-config`` prints each as a warning (exit 0); nothing here refuses a config.
"""

from __future__ import annotations

from vacancyd.config.model import Settings

#: Resource kinds whose free memory a model's footprint is charged against.
MEMORY_KINDS = frozenset({"gpu", "memory"})


def config_warnings(settings: Settings) -> list[str]:
    """One line per piece of advice, each naming the key it is about.

    * ``[upstream.models] default_mib = 0`` (also the default) on an upstream whose primary
      resource is a GPU or memory: a model missing from ``footprint_mib`` is charged
      nothing, so only the resource's ``min_free_mib`` stands between it and the owner's
      memory until its footprint has been learned.
    """
    kinds = {r.name: r.kind for r in settings.resource}
    out = []
    for i, up in enumerate(settings.upstream):
        if up.models.default_mib == 0 and kinds.get(up.resource) in MEMORY_KINDS:
            listed = len(up.models.footprint_mib)
            out.append(
                f"upstream[{i}] ({up.name}): [upstream.models] default_mib is 0, so a model "
                + (f"not among the {listed} in footprint_mib" if listed else "without a footprint")
                + f" is charged nothing and only {up.resource}'s min_free_mib protects the "
                "owner's memory; measure the models (vacancyd measure) and set default_mib to "
                "the largest footprint you will lend"
            )
    return out
