"""Tools for writing and checking plugins.

* :mod:`~llamagym.devtools.scaffold`: ``llamagym new-plugin``, which writes a plugin
  package from the files under ``templates/``;
* :mod:`~llamagym.devtools.conformance`: the checks of ``llamagym check`` (and of
  :func:`llamagym.testing.assert_agent_conforms`);
* :mod:`~llamagym.devtools.fake_model`: the scripted fake language model those checks
  and the ``fake_llm`` fixture of :mod:`llamagym.testing` play with.

Plugin authors' tests reach these through the fixtures and helpers of
:mod:`llamagym.testing`; the fake model's errors are imported from ``fake_model``.
"""
