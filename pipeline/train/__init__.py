"""The train stage: ``launch`` (the rule's entry: submit and wait) and ``worker`` (one rank)."""
