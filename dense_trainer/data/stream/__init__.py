"""Training rows from event streams (issue 37): impressions and their feedback, joined.

    source.py         the interface: entries read at least once, acknowledged once trained and
                      checkpointed, malformed ones to a dead-letter stream; retried while the
                      broker restarts
    redis_streams.py  Redis Streams (consumer groups: XREADGROUP, XACK, a consumer's pending
                      entries read again after a restart)
    joiner.py         impressions + feedback -> labelled rows: a click joins its impression, a
                      window without one makes a negative; bounded memory, late clicks counted
    batches.py        entries in time order -> joiner -> the shared featurizer -> batches;
                      malformed entries to the dead letters
    config.py         ``[stream]``: the settings of ``dlrm train --stream``
    replay.py         a file (any input format) published into the two streams at a chosen
                      rate, clicks after a delay: `dlrm stream replay`

A Kafka source (confluent-kafka) would be one more module beside ``redis_streams.py``: a
consumer group per job, ``poll`` for :meth:`StreamSource.read`, offsets committed only in
:meth:`StreamSource.ack` (``enable.auto.commit = false``), and a dead-letter topic.
"""
