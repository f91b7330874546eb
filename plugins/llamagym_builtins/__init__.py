"""Built-in plugins, registered through the ``llamagym`` entry-point group exactly as a
third-party package would register its own."""
