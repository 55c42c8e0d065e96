"""A third memory family written outside engramrt, as another distribution would ship it:
its family value (:mod:`.family`) and its command-line hooks (:mod:`.command_line`),
registered with ``register_family`` alone (tests/families/test_third_family.py)."""
