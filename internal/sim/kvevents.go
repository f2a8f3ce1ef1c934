package sim

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// KV event encodings: vLLM's msgspec array_like batches and events, or the tagged-map form of
// newer vLLM builds and SGLang.
const (
	KVEventsArray = "array"
	KVEventsMap   = "map"
)

// kvPublisher publishes the engine's prefix cache changes as vLLM and SGLang do: a ZMQ PUB
// socket bound to the engine's host (or dialling a gateway that listens), multipart [topic, seq
// (8 bytes, big-endian, from 0 at start), msgpack KVEventBatch].
type kvPublisher struct {
	mu        sync.Mutex
	sock      zmq4.Socket
	seq       uint64
	encoding  string
	topic     string
	dropEvery int // fault: every Nth batch is not published (still kept for replay); 0 never
	// sglang: events carry SGLang's fields only (BlockStored without medium and the later
	// fields, BlockRemoved with its hashes alone).
	sglang bool
	// connect: the PUB socket dials this endpoint (a gateway listening for engines) instead of
	// binding; "" binds.
	connect string
	// hybrid: a hybrid-attention model (vLLM): every block is announced for group 0
	// (full_attention) and group 1 (sliding_window), and the sliding-window group frees a
	// chain's blocks but its last as soon as they leave its window.
	hybrid bool
	// replayPort is the replay ROUTER's port; 0 picks a free one.
	replayPort int
	// legacy: older SGLang's hashes — a block's own tokens alone, a parent even for the first.
	legacy bool
	// ranked: the publisher of one DP rank's cache; its batches name rank.
	ranked bool
	rank   int
	stop   context.CancelFunc

	// The replay endpoint (a ROUTER): the last replayBuffer batches, for a subscriber that
	// missed some, as vLLM's replay_endpoint keeps buffer_steps of them.
	replay zmq4.Socket
	buffer []replayed
}

type replayed struct {
	seq     uint64
	payload []byte
}

const replayBuffer = 10000

// startKVPublisher binds the PUB socket on host:port (or, with p.connect set, dials that
// endpoint) and the replay ROUTER on a free port of host.
func startKVPublisher(host string, port int, p *kvPublisher) (*kvPublisher, error) {
	ctx, cancel := context.WithCancel(context.Background())
	p.stop = cancel
	var opts []zmq4.Option
	if p.connect != "" {
		// Only a socket that dials may redial: the library redials a socket's endpoint whenever
		// a peer leaves, which for a bound socket would dial its own address.
		opts = []zmq4.Option{zmq4.WithAutomaticReconnect(true), zmq4.WithDialerRetry(100 * time.Millisecond), zmq4.WithDialerMaxRetries(-1)}
	}
	sock := zmq4.NewPub(ctx, opts...)
	if p.connect != "" {
		// As engines do, connect in the background: the gateway may not be listening yet, and
		// batches published until it is are lost.
		go func() { _ = sock.Dial(p.connect) }()
	} else if err := sock.Listen(fmt.Sprintf("tcp://%s", net.JoinHostPort(host, fmt.Sprint(port)))); err != nil {
		return nil, fmt.Errorf("sim kv events: %w", err)
	}
	router := zmq4.NewRouter(context.Background())
	if err := router.Listen(fmt.Sprintf("tcp://%s", net.JoinHostPort(host, fmt.Sprint(p.replayPort)))); err != nil {
		_ = sock.Close()
		return nil, fmt.Errorf("sim kv events replay: %w", err)
	}
	p.sock, p.replay = sock, router
	go p.serveReplay()
	return p, nil
}

// replayEndpoint is where a subscriber asks for missed batches.
func (p *kvPublisher) replayEndpoint() string { return "tcp://" + p.replay.Addr().String() }

// serveReplay answers ["", start_seq] with ["", topic, seq, payload] for every buffered batch
// from start_seq on, then the end marker (seq -1, empty payload); SGLang answers without the
// topic frame.
func (p *kvPublisher) serveReplay() {
	for {
		msg, err := p.replay.Recv()
		if err != nil {
			return
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue
		}
		id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		p.mu.Lock()
		var out []replayed
		for _, b := range p.buffer {
			if b.seq >= start {
				out = append(out, b)
			}
		}
		p.mu.Unlock()
		for _, b := range out {
			var seq [8]byte
			binary.BigEndian.PutUint64(seq[:], b.seq)
			_ = p.replay.Send(p.replayMsg(id, seq[:], b.payload))
		}
		end := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
		_ = p.replay.Send(p.replayMsg(id, end, nil))
	}
}

func (p *kvPublisher) replayMsg(id, seq, payload []byte) zmq4.Msg {
	if p.sglang {
		return zmq4.NewMsgFrom(id, nil, seq, payload)
	}
	return zmq4.NewMsgFrom(id, nil, []byte(p.topic), seq, payload)
}

// endpoint is where subscribers connect ("" when the publisher dials out).
func (p *kvPublisher) endpoint() string {
	if p.connect != "" {
		return ""
	}
	return "tcp://" + p.sock.Addr().String()
}

// port is the PUB socket's bound port (0 when it dials out).
// replayPort is the replay ROUTER's bound port.
func (p *kvPublisher) boundReplayPort() int {
	if a, ok := p.replay.Addr().(*net.TCPAddr); ok {
		return a.Port
	}
	return 0
}

func (p *kvPublisher) port() int {
	if p.connect != "" {
		return 0
	}
	if a, ok := p.sock.Addr().(*net.TCPAddr); ok {
		return a.Port
	}
	return 0
}

func (p *kvPublisher) close() {
	p.stop()
	_ = p.sock.Close()
	_ = p.replay.Close()
}

// publish sends one batch: a BlockStored per stored block (with its parent, 0 for none → nil),
// then one BlockRemoved for the evicted blocks.
func (p *kvPublisher) publish(stored []storedBlock, removed []uint64) {
	if p.legacy {
		stored = legacyHashes(stored)
		removed = nil // their content-only hashes are not kept: older SGLang's removals say as little
	}
	var events []any
	for _, b := range stored {
		var parent, lora any
		if b.parent != 0 {
			parent = b.parent
		}
		if b.lora != "" {
			lora = b.lora
		}
		groups := []any{0}
		kinds := []any{nil}
		if p.hybrid {
			groups, kinds = []any{0, 1}, []any{"full_attention", "sliding_window"}
		}
		switch {
		case p.sglang && p.encoding == KVEventsMap:
			events = append(events, map[string]any{"type": "BlockStored", "block_hashes": []uint64{b.key}, "parent_block_hash": parent,
				"token_ids": b.tokens, "block_size": blockSize, "lora_id": nil, "lora_name": lora})
		case p.sglang:
			events = append(events, []any{"BlockStored", []uint64{b.key}, parent, b.tokens, blockSize, nil})
		case p.encoding == KVEventsMap:
			for g := range groups {
				ev := map[string]any{"type": "BlockStored", "block_hashes": []uint64{b.key}, "parent_block_hash": parent,
					"token_ids": b.tokens, "block_size": blockSize, "medium": "GPU", "lora_name": lora, "event_version": 1}
				if p.hybrid {
					ev["group_idx"], ev["kv_cache_spec_kind"] = groups[g], kinds[g]
				}
				events = append(events, ev)
			}
		default:
			for g := range groups {
				ev := []any{"BlockStored", []uint64{b.key}, parent, b.tokens, blockSize, nil, "GPU", lora, nil, groups[g]}
				if p.hybrid {
					ev = append(ev, kinds[g], nil)
				}
				events = append(events, ev)
			}
		}
	}
	if p.hybrid && len(stored) > 1 {
		slid := make([]uint64, 0, len(stored)-1)
		for _, b := range stored[:len(stored)-1] {
			slid = append(slid, b.key)
		}
		if p.encoding == KVEventsMap {
			events = append(events, map[string]any{"type": "BlockRemoved", "block_hashes": slid, "medium": "GPU", "group_idx": 1})
		} else {
			events = append(events, []any{"BlockRemoved", slid, "GPU", 1})
		}
	}
	if len(removed) > 0 {
		switch {
		case p.sglang && p.encoding == KVEventsMap:
			events = append(events, map[string]any{"type": "BlockRemoved", "block_hashes": removed})
		case p.sglang:
			events = append(events, []any{"BlockRemoved", removed})
		case p.encoding == KVEventsMap:
			events = append(events, map[string]any{"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"})
		default:
			events = append(events, []any{"BlockRemoved", removed, "GPU", 0})
		}
	}
	ts := float64(time.Now().UnixNano()) / 1e9
	var batch any = []any{ts, events}
	switch {
	case p.encoding == KVEventsMap && p.ranked:
		batch = map[string]any{"ts": ts, "events": events, "data_parallel_rank": p.rank}
	case p.encoding == KVEventsMap:
		batch = map[string]any{"ts": ts, "events": events}
	case p.ranked:
		batch = []any{ts, events, p.rank}
	}
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(batch); err != nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var seq [8]byte
	binary.BigEndian.PutUint64(seq[:], p.seq)
	p.buffer = append(p.buffer, replayed{seq: p.seq, payload: buf.Bytes()})
	if len(p.buffer) > replayBuffer {
		p.buffer = p.buffer[len(p.buffer)-replayBuffer:]
	}
	p.seq++
	if p.dropEvery > 0 && p.seq%uint64(p.dropEvery) == 0 {
		return // lost on the way, as a PUB drops for a slow subscriber
	}
	_ = p.sock.SendMulti(zmq4.NewMsgFrom([]byte(p.topic), seq[:], buf.Bytes()))
}

// legacyHashes rewrites stored blocks as older SGLang announced them: each block's hash of its own
// tokens, its parent the previous block's such hash, and the first block's parent a hash too.
func legacyHashes(stored []storedBlock) []storedBlock {
	out := make([]storedBlock, len(stored))
	parent := uint64(0x51a9)
	for i, b := range stored {
		h := uint64(0xcbf29ce484222325)
		for _, t := range b.tokens {
			h = mix(h ^ uint64(t))
		}
		out[i] = storedBlock{key: h, parent: parent, tokens: b.tokens, lora: b.lora}
		parent = h
	}
	return out
}
