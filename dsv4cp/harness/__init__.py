"""The harness: one :class:`~dsv4cp.harness.case.Case` (which layer, which batch, how it runs), one seeded
builder of its layer and inputs (:mod:`.build`), and the passes run over a Case (:mod:`.parity`, ...).

Every command builds a Case (from its flags, or from a sweep point) and runs passes over it, so two passes
of one Case (a timed sweep point and its parity check) see the same weights and inputs.
"""
