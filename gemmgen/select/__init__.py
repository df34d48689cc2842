"""Selection and tuning: the problem a call poses, the registry of built instances, the selection
engine (candidates with reasons, tuned buckets, heuristic), the tuning database and the tuner."""
