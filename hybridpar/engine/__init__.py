"""Running a job: the training loop (``train``), data (``data``: tokens, ``image_data``:
images), process launch (``launch``, ``env``), metrics (``tb``) and timelines (``trace``)."""
