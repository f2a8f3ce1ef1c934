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

// kvPublisher publishes the engine's prefix cache changes as vLLM does: a ZMQ PUB socket bound
// to the engine's host, multipart [topic, seq (8 bytes, big-endian, from 0 at start), msgpack
// KVEventBatch].
type kvPublisher struct {
	mu       sync.Mutex
	sock     zmq4.Socket
	seq      uint64
	encoding string
	topic    string
}

func startKVPublisher(host string, port int, encoding, topic string) (*kvPublisher, error) {
	sock := zmq4.NewPub(context.Background())
	if err := sock.Listen(fmt.Sprintf("tcp://%s", net.JoinHostPort(host, fmt.Sprint(port)))); err != nil {
		return nil, fmt.Errorf("sim kv events: %w", err)
	}
	return &kvPublisher{sock: sock, encoding: encoding, topic: topic}, nil
}

// endpoint is where subscribers connect.
func (p *kvPublisher) endpoint() string { return "tcp://" + p.sock.Addr().String() }

func (p *kvPublisher) close() { _ = p.sock.Close() }

// publish sends one batch: a BlockStored per stored block (with its parent, 0 for none → nil),
// then one BlockRemoved for the evicted blocks.
func (p *kvPublisher) publish(stored []storedBlock, removed []uint64) {
	var events []any
	for _, b := range stored {
		var parent any
		if b.parent != 0 {
			parent = b.parent
		}
		if p.encoding == KVEventsMap {
			events = append(events, map[string]any{"type": "BlockStored", "block_hashes": []uint64{b.key}, "parent_block_hash": parent,
				"token_ids": b.tokens, "block_size": blockSize, "medium": "GPU", "event_version": 1})
		} else {
			events = append(events, []any{"BlockStored", []uint64{b.key}, parent, b.tokens, blockSize, nil, "GPU", nil, nil, 0})
		}
	}
	if len(removed) > 0 {
		if p.encoding == KVEventsMap {
			events = append(events, map[string]any{"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"})
		} else {
			events = append(events, []any{"BlockRemoved", removed, "GPU", 0})
		}
	}
	ts := float64(time.Now().UnixNano()) / 1e9
	var batch any = []any{ts, events}
	if p.encoding == KVEventsMap {
		batch = map[string]any{"ts": ts, "events": events}
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
	p.seq++
	_ = p.sock.SendMulti(zmq4.NewMsgFrom([]byte(p.topic), seq[:], buf.Bytes()))
}
