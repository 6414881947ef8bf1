"""Data sets of the study: config checks (`checks`), one-off preparation (`prepare`, reading the
sources' files with `formats` and `image_folder`) and fast batch loading (`loading`)."""
