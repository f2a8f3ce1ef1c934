package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"log/slog"
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/vmihailenco/msgpack/v5"
)

// pack encodes v as an engine would (msgspec writes arrays for array_like structs and maps for
// the tagged-map form; both are plain msgpack).
func pack(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// Payloads built from the engines' definitions (vLLM distributed/kv_events.py: KVEventBatch
// [ts, events, data_parallel_rank?]; BlockStored [tag, block_hashes, parent_block_hash,
// token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, …]; BlockRemoved
// [tag, block_hashes, medium, group_idx]; AllBlocksCleared [tag]).
func TestDecodeArrayForm(t *testing.T) {
	big := uint64(math.MaxUint64 - 5) // above int64: msgpack uint64
	p := pack(t, []any{1.5, []any{
		[]any{"BlockStored", []any{int64(-7), big}, nil, []any{1, 2, 3, 4, 5, 6, 7, 8}, 4, nil, "GPU", nil, []any{nil, nil}, 0, "full", nil},
		[]any{"BlockStored", []any{11}, int64(-7), []any{9, 10, 11, 12}, 4}, // the shortest form
		[]any{"BlockRemoved", []any{big}, "GPU", nil},
		[]any{"BlockRemoved", []any{11}},
		[]any{"SomethingNew", 1, 2, []any{3}},
		[]any{"AllBlocksCleared"},
	}, 3})
	b, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{TS: 1.5, DPRank: 3, HasDPRank: true, Ignored: 1, Events: []Event{
		{Kind: KindStored, Hashes: []uint64{uint64(math.MaxUint64 - 6), big}, Tokens: []uint32{1, 2, 3, 4, 5, 6, 7, 8}, BlockSize: 4, Medium: "GPU", Group: 0, SpecKind: "full"},
		{Kind: KindStored, Hashes: []uint64{11}, Parent: uint64(math.MaxUint64 - 6), HasParent: true, Tokens: []uint32{9, 10, 11, 12}, BlockSize: 4, Group: -1},
		{Kind: KindRemoved, Hashes: []uint64{big}, Medium: "GPU", Group: -1},
		{Kind: KindRemoved, Hashes: []uint64{11}, Group: -1},
		{Kind: KindCleared, Group: -1},
	}}
	if d := cmp.Diff(want, b); d != "" {
		t.Fatalf("decoded (-want +got):\n%s", d)
	}
	// Without the trailing rank (its default omitted).
	b, err = Decode(pack(t, []any{2.0, []any{[]any{"AllBlocksCleared"}}}))
	if err != nil || b.HasDPRank || len(b.Events) != 1 {
		t.Fatalf("%+v %v", b, err)
	}
}

// The tagged-map form (vLLM after its 2026 change, SGLang): fields by name, unknown keys
// ignored, hashes as 32 raw bytes folded to their last 8.
func TestDecodeMapForm(t *testing.T) {
	h := make([]byte, 32)
	h[0] = 0xAA
	binary.BigEndian.PutUint64(h[24:], 0x0102030405060708)
	p := pack(t, map[string]any{"ts": 9.25, "data_parallel_rank": 1, "events": []any{
		map[string]any{"type": "BlockStored", "block_hashes": []any{h}, "parent_block_hash": nil, "token_ids": []any{5, 6},
			"block_size": 2, "lora_name": "adapter", "cache_salt": "s", "locality": map[string]any{"x": []any{1}}, "event_version": 2},
		map[string]any{"type": "BlockRemoved", "block_hashes": []any{h}, "session_id": "abc"},
		map[string]any{"type": "AllBlocksCleared"},
		map[string]any{"type": "Future", "what": 1},
	}, "extra": "ignored"})
	b, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{TS: 9.25, DPRank: 1, HasDPRank: true, Ignored: 1, Events: []Event{
		{Kind: KindStored, Hashes: []uint64{0x0102030405060708}, Tokens: []uint32{5, 6}, BlockSize: 2, LoRA: "adapter", Group: -1},
		{Kind: KindRemoved, Hashes: []uint64{0x0102030405060708}, Group: -1},
		{Kind: KindCleared, Group: -1},
	}}
	if d := cmp.Diff(want, b); d != "" {
		t.Fatalf("decoded (-want +got):\n%s", d)
	}
	// A legacy simulator's parent 0 means the root.
	b, err = Decode(pack(t, []any{0.0, []any{[]any{"BlockStored", []any{1}, 0, []any{1}, 1}}}))
	if err != nil || b.Events[0].HasParent {
		t.Fatalf("parent 0: %+v %v", b, err)
	}
}

func TestDecodeRefusesMalformed(t *testing.T) {
	deep := []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x92, 0xa7}
	deep = append(deep, "Unknown"...)
	for i := 0; i < 100; i++ {
		deep = append(deep, 0x91)
	}
	deep = append(deep, 0xc0)
	cases := map[string][]byte{
		"empty":               nil,
		"not an array":        pack(t, "hello"),
		"one field":           pack(t, []any{1.0}),
		"events not an array": pack(t, []any{1.0, 5}),
		"array claims 2^32":   {0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff},
		"hashes claim 2^32":   append([]byte{0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91, 0x92, 0xac}, append([]byte("BlockRemoved"), 0xdd, 0xff, 0xff, 0xff, 0xff)...),
		"negative token":      pack(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{-1}, 1}}}),
		"zero block size":     pack(t, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1}, 0}}}),
		"stored too short":    pack(t, []any{1.0, []any{[]any{"BlockStored", []any{1}}}}),
		"deep nesting":        deep,
		"truncated":           pack(t, []any{1.0, []any{[]any{"BlockStored", []any{1, 2, 3}, nil, []any{1, 2, 3}, 1}}})[:20],
	}
	for name, p := range cases {
		if _, err := Decode(p); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err %v, want ErrMalformed", name, err)
		}
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(pack(f, []any{1.5, []any{[]any{"BlockStored", []any{1, 2}, nil, []any{1, 2, 3, 4}, 2, nil, "GPU"}, []any{"BlockRemoved", []any{1}}, []any{"AllBlocksCleared"}}, 1}))
	f.Add(pack(f, map[string]any{"ts": 1.0, "events": []any{map[string]any{"type": "BlockStored", "block_hashes": []any{[]byte("0123456789abcdef")}, "token_ids": []any{1}, "block_size": 1}}}))
	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := Decode(p)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				// every failure is reported as malformed (wrapped with its position)
				t.Fatalf("error %v is not ErrMalformed", err)
			}
			return
		}
		for _, e := range b.Events {
			if len(e.Tokens) > len(p) || len(e.Hashes) > len(p) {
				t.Fatalf("decoded more elements than the payload has bytes")
			}
		}
	})
}

// FuzzSubscriberHandle feeds arbitrary messages (frames split at 0x00 0x00) to a subscriber:
// no panic, and every message is counted received, and either applied or counted malformed.
func FuzzSubscriberHandle(f *testing.F) {
	seq := make([]byte, 8)
	good := pack(f, []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []any{1, 2}, 2}}})
	f.Add(bytes.Join([][]byte{[]byte("topic"), seq, good}, []byte{0, 0}))
	f.Add([]byte{0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		s := &Subscriber{Worker: "w", Model: "m", Index: NewIndex(1000), Log: slog.New(slog.DiscardHandler)}
		frames := bytes.Split(data, []byte{0, 0})
		s.handle(frames)
		s.handle(frames) // the same again: a sequence that did not advance
		st := s.Stats()
		if st.Received != 2 {
			t.Fatalf("received %d of 2", st.Received)
		}
		if n, _ := s.Index.Size(); n > 1000 {
			t.Fatalf("index beyond its bound: %d", n)
		}
	})
}
