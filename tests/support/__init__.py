"""Test machinery that no shipped service needs: the step gate, servers on in-process threads, async clients."""
