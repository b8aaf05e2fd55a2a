"""The driver's own view of each engine's KV cache, from the engine's ZMQ events (DESIGN §3),
independent of kvpick: a SUB socket per engine (pyzmq, the library vLLM publishes with) and
msgspec's msgpack decoder, the same pair vLLM uses.

Per engine it keeps the blocks the engine announced and has not removed, counted per hash (an
equal block can be stored twice and is gone at its last removal), each with its parent and
tokens, so the token chain of any held block can be rebuilt and handed to kvpick's
`/debug/prefix`. Every batch is also kept (decoded, in order) for the run's capture.
"""

import threading
import time

import msgspec
import zmq


class EngineView:
    """One engine's announced blocks."""

    def __init__(self):
        self.refs = {}  # hash -> count of live stores
        self.meta = {}  # hash -> (parent hash | None, tuple(tokens))
        self.block_size = None
        self.batches = 0
        self.last_seq = None
        self.gaps = 0
        self.restarts = 0

    def apply(self, seq, events):
        if self.last_seq is not None and seq != self.last_seq + 1:
            if seq < self.last_seq:
                # A restarted engine numbers from 0 again and its cache is empty.
                self.restarts += 1
            else:
                self.gaps += 1
        self.last_seq = seq
        self.batches += 1
        for e in events:
            kind = e.get("type") if isinstance(e, dict) else e[0]
            if not isinstance(e, dict):
                continue  # pre-0.24 array events: not what vLLM 0.32 sends
            if kind == "BlockStored":
                hashes = e.get("block_hashes") or []
                tokens = e.get("token_ids") or []
                bs = e.get("block_size") or self.block_size
                self.block_size = bs
                parent = e.get("parent_block_hash")
                for i, h in enumerate(hashes):
                    own = tuple(tokens[i * bs:(i + 1) * bs]) if bs else ()
                    self.refs[h] = self.refs.get(h, 0) + 1
                    self.meta[h] = (parent, own)
                    parent = h
            elif kind == "BlockRemoved":
                for h in e.get("block_hashes") or []:
                    n = self.refs.get(h, 0) - 1
                    if n <= 0:
                        self.refs.pop(h, None)
                        self.meta.pop(h, None)
                    else:
                        self.refs[h] = n
            elif kind == "AllBlocksCleared":
                self.refs.clear()
                self.meta.clear()

    def chain(self, h):
        """(hashes root..h, tokens root..h), or None when an ancestor is not held."""
        hashes, parts = [], []
        while h is not None:
            if h not in self.meta:
                return None
            hashes.append(h)
            parent, own = self.meta[h]
            parts.append(own)
            h = parent
        hashes.reverse()
        parts.reverse()
        return hashes, [t for p in parts for t in p]

    def leaves(self):
        parents = {p for p, _ in self.meta.values()}
        return [h for h in self.meta if h not in parents]

    def held_prefix(self, hashes):
        """How many leading blocks of a chain this engine holds."""
        n = 0
        for h in hashes:
            if h not in self.refs:
                break
            n += 1
        return n


class EventWatcher(threading.Thread):
    """Subscribes to every engine's PUB endpoint before any traffic and applies each batch."""

    def __init__(self, endpoints):
        super().__init__(daemon=True)
        self.endpoints = endpoints  # pod address -> tcp://host:port
        self.views = {pod: EngineView() for pod in endpoints}
        self.log = []  # (pod, seq, ts, events) in arrival order
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.last_batch = time.monotonic()
        self.decoder = msgspec.msgpack.Decoder()
        self.ctx = zmq.Context()
        self.socks = {}
        for pod, ep in endpoints.items():
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.RCVTIMEO, 100)
            s.connect(ep)
            self.socks[pod] = s

    def run(self):
        poller = zmq.Poller()
        by_sock = {}
        for pod, s in self.socks.items():
            poller.register(s, zmq.POLLIN)
            by_sock[s] = pod
        while not self.stopping.is_set():
            for s, _ in poller.poll(100):
                frames = s.recv_multipart()
                if len(frames) < 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                payload = self.decoder.decode(frames[2])
                ts, events = payload[0], payload[1]
                pod = by_sock[s]
                with self.lock:
                    self.views[pod].apply(seq, events)
                    self.log.append((pod, seq, ts, events))
                    self.last_batch = time.monotonic()

    def forget(self, pod):
        """The engine was killed: its cache is gone with it."""
        with self.lock:
            self.views[pod] = EngineView()

    def quiet_for(self, seconds):
        with self.lock:
            return time.monotonic() - self.last_batch >= seconds

    def snapshot(self):
        """A consistent copy of every view: {pod: (refs, meta, block_size)}."""
        with self.lock:
            out = {}
            for pod, v in self.views.items():
                c = EngineView()
                c.refs, c.meta, c.block_size = dict(v.refs), dict(v.meta), v.block_size
                c.gaps, c.restarts, c.batches = v.gaps, v.restarts, v.batches
                out[pod] = c
            return out

    def close(self):
        self.stopping.set()
        self.join(timeout=2)
        for s in self.socks.values():
            s.close(linger=0)
        self.ctx.term()
