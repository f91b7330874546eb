"""The plugin runtime: how plugins are found, what they may extend, what they register,
and how each is kept from harming a run.

* :mod:`~llamagym.plugin_runtime.hookspecs`: every hook (pluggy's hook specifications)
  and the ``hookimpl`` marker;
* :mod:`~llamagym.plugin_runtime.registry`: what plugins register, as typed frozen
  entries (agents, algorithms, models), the registry holding them, and ``RunContext``;
* :mod:`~llamagym.plugin_runtime.manager`: entry-point discovery, the registry filled by
  plugins, typed hook calls (``get_plugins``);
* :mod:`~llamagym.plugin_runtime.isolation`: each plugin behind a stand-in: its failures
  reported and skipped, its answers checked, a time limit;
* :mod:`~llamagym.plugin_runtime.hook_values`: what a per-step hook is handed (read-only
  views) and what it may answer;
* :mod:`~llamagym.plugin_runtime.agent_plugin`: the built-in plugin through which an
  agent's own methods answer the per-step hooks.

It imports nothing of LlamaGym above the config, the display and the errors.
"""
