"""A vLLM-like KV-event publisher on real libzmq (pyzmq), for the transport interop test.

It binds a PUB (live batches) and a ROUTER (replay: DESIGN section 3) on free loopback ports,
prints `PUB <endpoint>` and `ROUTER <endpoint>`, then waits for commands on stdin:
  `publish <dir> <topic> <lost seqs, comma separated or ->`  publishes the capture in <dir>
                                                            (NNNN.msgpack) as seqs 0.., skipping
                                                            the lost ones on the wire (kept for
                                                            replay); prints `published N`
  `quit` (or EOF)                                           closes both sockets
Replay requests are served from a background thread the whole time, like vLLM's.
"""

import os
import sys
import threading

import zmq

ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER)
router_port = router.bind_to_random_port("tcp://127.0.0.1")
buffer = []  # (seq, topic, payload)
lock = threading.Lock()
stop = threading.Event()


def serve_replay():
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while not stop.is_set():
        if not dict(poller.poll(50)).get(router):
            continue
        frames = router.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        with lock:
            replies = [b for b in buffer if b[0] >= start]
        for seq, topic, payload in replies:
            router.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
        router.send_multipart([identity, b"", b"", b"\xff" * 8, b""])


thread = threading.Thread(target=serve_replay, daemon=True)
thread.start()
print(f"PUB tcp://127.0.0.1:{pub_port}", flush=True)
print(f"ROUTER tcp://127.0.0.1:{router_port}", flush=True)
for line in sys.stdin:
    parts = line.split()
    if not parts or parts[0] == "quit":
        break
    if parts[0] == "publish":
        folder, topic, lost = parts[1], parts[2].encode(), parts[3]
        lost = set() if lost == "-" else {int(s) for s in lost.split(",")}
        seq = 0
        while os.path.exists(os.path.join(folder, f"{seq:04}.msgpack")):
            with open(os.path.join(folder, f"{seq:04}.msgpack"), "rb") as f:
                payload = f.read()
            with lock:
                buffer.append((seq, topic, payload))
            if seq not in lost:
                pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            seq += 1
        print(f"published {seq}", flush=True)
stop.set()
thread.join()
pub.close(linger=0)
router.close(linger=0)
ctx.term()
