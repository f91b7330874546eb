"""LlamaGym's CartPole plugin: agent ``cartpole`` on Gymnasium's ``CartPole-v1``."""
