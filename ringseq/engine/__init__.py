"""The engine: everything below an entry point's validated :class:`ringseq.spec.AttnSpec`.

- :mod:`.op`: the one custom operator ``ringseq::attention`` (autograd, torch.compile);
- :mod:`.placement`: where a call runs (local kernel, ring) and its string encoding;
- :mod:`.plan`: a ring call's schedule, what travels and its signature (derived, cached);
- :mod:`.loops`: the one forward loop and the one backward loop of the ring;
- :mod:`.transport`: what moves bytes (exchange, control collective); :mod:`.ring`: a group's
  ring (transport + integrity state); :mod:`.integrity`: calls, headers, failures;
- :mod:`.sim`: a ring of threads; :mod:`.counting`: bytes sent.
"""
