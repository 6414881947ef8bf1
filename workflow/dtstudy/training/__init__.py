"""One worker's training: the loop, the CNNs, the learning-rate schedule, stragglers,
measurements, checkpoint and resume, and the test pass of a finished run."""
