"""Entry point of the plugin: registers the agent without importing it (fast CLI)."""

from llamagym import hookimpl


@hookimpl
def llamagym_register_agents(register) -> None:
    register(
        "blackjack",
        "llamagym_blackjack.agent:BlackjackAgent",
        description="Blackjack-v1: stick or hit against the dealer",
        env_id="Blackjack-v1",
    )
