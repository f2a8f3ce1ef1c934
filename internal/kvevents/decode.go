// Package kvevents reads the KV-cache events vLLM and SGLang publish (blocks stored, removed,
// all cleared) and keeps an index of which blocks each engine holds, keyed by Baton's own chained
// hash of the blocks' tokens.
//
// The payload of one message is a msgpack KVEventBatch: [ts, [event, …], dp_rank?] (msgspec
// array_like, the trailing rank omitted at its default) or, from some builds, a map {ts, events,
// data_parallel_rank}. An event is a tagged array ["BlockStored", block_hashes, parent_block_hash,
// token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, …]
// / ["BlockRemoved", block_hashes, medium, group_idx, …] / ["AllBlocksCleared"], or a map keyed by "type" with the same field names. Positions past
// the required ones may be missing; unknown trailing fields, unknown keys and unknown event types
// are ignored (and counted), never fatal. A hash is a 64-bit integer (signed or not) or bytes
// (folded to their last 8, big-endian), so both of vLLM's hash modes give one key.
//
// Everything here is bounded by the payload: no length a payload claims is allocated before the
// bytes to fill it are there, and nesting is limited.
package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Kind is what an event says.
type Kind uint8

// Event kinds.
const (
	KindUnknown Kind = iota // a type Baton does not know: ignored
	KindStored              // BlockStored
	KindRemoved             // BlockRemoved
	KindCleared             // AllBlocksCleared
)

// Event is one decoded KV-cache event.
type Event struct {
	Kind   Kind
	Hashes []uint64 // block_hashes, in chain order
	// Parent is parent_block_hash; HasParent is false for a chain from the root (nil, or the
	// 0 some simulators send).
	Parent    uint64
	HasParent bool
	Tokens    []uint32 // token_ids: len(Hashes) × BlockSize for full blocks; may be empty (CPU offload)
	BlockSize int
	LoRA      string // lora_name, "" for the base model
	Medium    string // "GPU", "CPU", or "" (unset: GPU)
	// Group is group_idx, the KV-cache group of a hybrid-attention model (vLLM announces the
	// same hashes once per group); -1 when absent. SpecKind is kv_cache_spec_kind
	// ("full_attention", "sliding_window", …), "" when absent.
	Group    int
	SpecKind string
}

// Batch is one message's events.
type Batch struct {
	TS        float64
	Events    []Event
	DPRank    int // data_parallel_rank; 0 when absent
	HasDPRank bool
	Ignored   int // events of unknown types, skipped
}

// maxDepth bounds the nesting of values skipped as unknown.
const maxDepth = 16

// ErrMalformed wraps every decoding failure.
var ErrMalformed = errors.New("malformed KV event batch")

func bad(format string, a ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, a...))
}

type decoder struct {
	r *bytes.Reader
	d *msgpack.Decoder
}

// Decode decodes one KVEventBatch payload.
func Decode(payload []byte) (b Batch, err error) {
	r := bytes.NewReader(payload)
	x := &decoder{r: r, d: msgpack.NewDecoder(r)}
	c, err := x.d.PeekCode()
	if err != nil {
		return b, bad("empty payload")
	}
	if isMap(c) {
		err = x.batchMap(&b)
	} else {
		err = x.batchArray(&b)
	}
	return b, err
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

// arrayLen reads an array header whose length the rest of the payload can hold (each element
// is at least one byte); nil reads as an empty array.
func (x *decoder) arrayLen(what string) (int, error) {
	n, err := x.d.DecodeArrayLen()
	if err != nil {
		return 0, bad("%s: want an array: %v", what, err)
	}
	if n < 0 {
		return 0, nil
	}
	if n > x.r.Len() {
		return 0, bad("%s: %d elements claimed, %d bytes left", what, n, x.r.Len())
	}
	return n, nil
}

func (x *decoder) mapLen(what string) (int, error) {
	n, err := x.d.DecodeMapLen()
	if err != nil {
		return 0, bad("%s: want a map: %v", what, err)
	}
	if n < 0 {
		return 0, nil
	}
	if 2*n > x.r.Len() {
		return 0, bad("%s: %d entries claimed, %d bytes left", what, n, x.r.Len())
	}
	return n, nil
}

func (x *decoder) batchArray(b *Batch) error {
	n, err := x.arrayLen("batch")
	if err != nil {
		return err
	}
	if n < 2 {
		return bad("batch: %d fields, want [ts, events, dp_rank?]", n)
	}
	if b.TS, err = x.d.DecodeFloat64(); err != nil {
		return bad("batch ts: %v", err)
	}
	if err := x.events(b); err != nil {
		return err
	}
	if n >= 3 {
		if err := x.rank(b); err != nil {
			return err
		}
	}
	return x.skipN(n-3, 0)
}

func (x *decoder) batchMap(b *Batch) error {
	n, err := x.mapLen("batch")
	if err != nil {
		return err
	}
	seen := false
	for i := 0; i < n; i++ {
		k, err := x.key()
		if err != nil {
			return err
		}
		switch k {
		case "ts":
			if b.TS, err = x.d.DecodeFloat64(); err != nil {
				return bad("batch ts: %v", err)
			}
		case "events":
			seen = true
			if err := x.events(b); err != nil {
				return err
			}
		case "data_parallel_rank":
			if err := x.rank(b); err != nil {
				return err
			}
		default:
			if err := x.skip(0); err != nil {
				return err
			}
		}
	}
	if !seen {
		return bad("batch: no events")
	}
	return nil
}

func (x *decoder) rank(b *Batch) error {
	if c, _ := x.d.PeekCode(); c == msgpcode.Nil {
		return x.d.DecodeNil()
	}
	v, err := x.d.DecodeInt64()
	if err != nil || v < 0 || v > math.MaxInt32 {
		return bad("data_parallel_rank: %v", err)
	}
	b.DPRank, b.HasDPRank = int(v), true
	return nil
}

func (x *decoder) key() (string, error) {
	k, err := x.d.DecodeString()
	if err != nil {
		return "", bad("map key: %v", err)
	}
	return k, nil
}

func (x *decoder) events(b *Batch) error {
	n, err := x.arrayLen("events")
	if err != nil {
		return err
	}
	b.Events = make([]Event, 0, min(n, 1024))
	for i := 0; i < n; i++ {
		e := Event{Group: -1}
		c, err := x.d.PeekCode()
		if err != nil {
			return bad("event %d: %v", i, err)
		}
		if isMap(c) {
			err = x.eventMap(&e)
		} else {
			err = x.eventArray(&e)
		}
		if err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
		if e.Kind == KindUnknown {
			b.Ignored++
			continue
		}
		b.Events = append(b.Events, e)
	}
	return nil
}

func kindOf(tag string) Kind {
	switch tag {
	case "BlockStored":
		return KindStored
	case "BlockRemoved":
		return KindRemoved
	case "AllBlocksCleared":
		return KindCleared
	}
	return KindUnknown
}

// The array forms' field positions after the tag.
var (
	storedFields = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
		"extra_keys", "group_idx", "kv_cache_spec_kind"}
	removedFields = []string{"block_hashes", "medium", "group_idx"}
)

func (x *decoder) eventArray(e *Event) error {
	n, err := x.arrayLen("event")
	if err != nil {
		return err
	}
	if n == 0 {
		return bad("event: empty")
	}
	tag, err := x.d.DecodeString()
	if err != nil {
		return bad("event tag: %v", err)
	}
	e.Kind = kindOf(tag)
	var fields []string
	switch e.Kind {
	case KindStored:
		fields = storedFields
		if n < 5 {
			return bad("BlockStored: %d fields, want at least 4", n-1)
		}
	case KindRemoved:
		fields = removedFields
		if n < 2 {
			return bad("BlockRemoved: no block_hashes")
		}
	}
	i := 1
	for ; i < n && i-1 < len(fields); i++ {
		if err := x.field(e, fields[i-1]); err != nil {
			return err
		}
	}
	return x.skipN(n-i, 0)
}

func (x *decoder) eventMap(e *Event) error {
	n, err := x.mapLen("event")
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		k, err := x.key()
		if err != nil {
			return err
		}
		if k == "type" {
			tag, err := x.d.DecodeString()
			if err != nil {
				return bad("event type: %v", err)
			}
			e.Kind = kindOf(tag)
			continue
		}
		if err := x.field(e, k); err != nil {
			return err
		}
	}
	if e.Kind == KindStored && len(e.Hashes) == 0 && e.BlockSize == 0 {
		return bad("BlockStored: no block_hashes or block_size")
	}
	return nil
}

// field decodes the field named k into e; unknown fields are skipped.
func (x *decoder) field(e *Event, k string) error {
	var err error
	switch k {
	case "block_hashes":
		e.Hashes, err = x.hashes()
	case "parent_block_hash":
		if c, _ := x.d.PeekCode(); c == msgpcode.Nil {
			return x.d.DecodeNil()
		}
		e.Parent, err = x.hash()
		e.HasParent = err == nil && e.Parent != 0
	case "token_ids":
		e.Tokens, err = x.tokens()
	case "block_size":
		var v int64
		if v, err = x.d.DecodeInt64(); err == nil && (v <= 0 || v > 1<<20) {
			err = fmt.Errorf("%d", v)
		}
		e.BlockSize = int(v)
	case "group_idx":
		if c, _ := x.d.PeekCode(); c == msgpcode.Nil {
			return x.d.DecodeNil()
		}
		var v int64
		if v, err = x.d.DecodeInt64(); err == nil && (v < 0 || v > 1<<16) {
			err = fmt.Errorf("%d", v)
		}
		e.Group = int(v)
	case "lora_name", "medium", "kv_cache_spec_kind":
		var s string
		if c, _ := x.d.PeekCode(); c == msgpcode.Nil {
			return x.d.DecodeNil()
		}
		if s, err = x.d.DecodeString(); err == nil && len(s) > 256 {
			err = fmt.Errorf("%d bytes", len(s))
		}
		switch k {
		case "medium":
			e.Medium = s
		case "lora_name":
			e.LoRA = s
		default:
			e.SpecKind = s
		}
	default:
		return x.skip(0)
	}
	if err != nil {
		return bad("%s: %v", k, err)
	}
	return nil
}

func (x *decoder) hashes() ([]uint64, error) {
	n, err := x.arrayLen("block_hashes")
	if err != nil {
		return nil, err
	}
	out := make([]uint64, n)
	for i := range out {
		if out[i], err = x.hash(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// hash reads a block hash: an integer (int64 or uint64) or bytes, folded to their last 8.
func (x *decoder) hash() (uint64, error) {
	c, err := x.d.PeekCode()
	if err != nil {
		return 0, err
	}
	switch {
	case msgpcode.IsBin(c) || msgpcode.IsString(c):
		b, err := x.d.DecodeBytes()
		if err != nil {
			return 0, err
		}
		if len(b) == 0 {
			return 0, errors.New("empty hash")
		}
		var buf [8]byte
		copy(buf[8-min(8, len(b)):], b[len(b)-min(8, len(b)):])
		return binary.BigEndian.Uint64(buf[:]), nil
	case c == msgpcode.Uint64:
		return x.d.DecodeUint64()
	default:
		v, err := x.d.DecodeInt64()
		return uint64(v), err
	}
}

func (x *decoder) tokens() ([]uint32, error) {
	n, err := x.arrayLen("token_ids")
	if err != nil {
		return nil, err
	}
	out := make([]uint32, n)
	for i := range out {
		v, err := x.d.DecodeInt64()
		if err != nil {
			return nil, err
		}
		if v < 0 || v > math.MaxUint32 {
			return nil, fmt.Errorf("token id %d", v)
		}
		out[i] = uint32(v)
	}
	return out, nil
}

func (x *decoder) skipN(n, depth int) error {
	for ; n > 0; n-- {
		if err := x.skip(depth); err != nil {
			return err
		}
	}
	return nil
}

// skip skips one value of any kind, bounding its nesting.
func (x *decoder) skip(depth int) error {
	if depth > maxDepth {
		return bad("nested deeper than %d", maxDepth)
	}
	c, err := x.d.PeekCode()
	if err != nil {
		return bad("%v", err)
	}
	switch {
	case isArray(c):
		n, err := x.arrayLen("value")
		if err != nil {
			return err
		}
		return x.skipN(n, depth+1)
	case isMap(c):
		n, err := x.mapLen("value")
		if err != nil {
			return err
		}
		return x.skipN(2*n, depth+1)
	}
	if err := x.d.Skip(); err != nil {
		return bad("%v", err)
	}
	return nil
}
