"""The config's resolver: a run's layers of settings and the one resolver over them.

* :mod:`~llamagym.resolver.layers`: the layers (the agent, its pretrained model's and
  the backend's defaults, the user's) and :func:`~llamagym.resolver.layers.resolve_config`,
  which merges, validates and keeps each key's source;
* :mod:`~llamagym.resolver.trl_arguments`: TRL's ``GRPOConfig`` from a run's settings,
  every ``trl.*`` value checked for the resolver.

It sits above :mod:`llamagym.models` and the plugin runtime, which it asks for model
defaults and algorithm classes; :mod:`llamagym.config` (the settings themselves) sits
below both.
"""
