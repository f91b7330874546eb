"""Playing episodes: the batched rollout engine, episodes and turns, evaluation
beside baselines, and recorded demonstrations."""
