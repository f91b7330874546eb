"""LlamaGym's Blackjack plugin: agent ``blackjack`` on Gymnasium's ``Blackjack-v1``."""
