"""Packages the tests install and run in processes of their own, such as the plugins that
LlamaGym 0.3's `llamagym new-plugin` wrote: their tests are theirs, not this suite's."""

collect_ignore = ["plugins-0.3"]
