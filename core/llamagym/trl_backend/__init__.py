"""The TRL backend (``--backend trl``): TRL's GRPOTrainer as the optimiser of a native
run (``trainer``), its rollout function (``rollout``), what carries over from a run's
settings and the seed dataset (``settings``), and a sharded model made whole for the
rollout and gathered at the end (``sharded``). A floor of its own above training, whose
loop, checkpoints and records it reuses; the settings it reads are checked below, by the
config resolver (``llamagym.resolver.trl_arguments``)."""
