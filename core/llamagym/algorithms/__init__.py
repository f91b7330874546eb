"""What every training algorithm builds on: the base class and the context it is built
with (``algorithm``), the settings every algorithm shares (``algorithm_config``), credit
across turns (``credit``), the loss terms (``losses``), the KL weight (``kl_control``),
how an update groups and cuts its batch (``batching``) and how it scores its turns
under the policy (``turn_scoring``). The algorithms themselves are plugins."""
