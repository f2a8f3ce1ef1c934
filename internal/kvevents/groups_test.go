package kvevents

import (
	"log/slog"
	"testing"
)

// Only full-attention groups are indexed: a sliding-window group's removals never erase the
// prefix; without announced kinds, group 0 alone; events of no group always.
func TestHybridGroups(t *testing.T) {
	toks := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	stored := func(group int, kind string) Event {
		return Event{Kind: KindStored, Hashes: []uint64{101, 102}, Tokens: toks, BlockSize: 4, Group: group, SpecKind: kind}
	}
	removed := func(group int) Event { return Event{Kind: KindRemoved, Hashes: []uint64{101}, Group: group} }
	for _, tc := range []struct {
		name   string
		events []Event
		want   int // leading blocks held
	}{
		{"kinds announced", []Event{stored(0, "full_attention"), stored(1, "sliding_window"), removed(1)}, 2},
		{"sliding window listed first", []Event{stored(0, "sliding_window"), stored(1, "full_attention"), removed(0)}, 2},
		{"full attention removal", []Event{stored(0, "full_attention"), stored(1, "sliding_window"), removed(0)}, 0},
		{"no kinds: group 0 alone", []Event{stored(0, ""), stored(1, ""), removed(1)}, 2},
		{"no groups", []Event{stored(-1, ""), removed(-1)}, 0},
		{"mamba is no prefix", []Event{stored(0, "mamba")}, 0},
	} {
		s := &Subscriber{Worker: "w", Model: "m", Index: NewIndex(100)}
		s.apply(Batch{Events: tc.events})
		if got := s.Index.Match(Keys("m", "", toks, 4))["w"]; got != tc.want {
			t.Errorf("%s: %d blocks held, want %d", tc.name, got, tc.want)
		}
		if tc.want > 0 && s.BlockSize() != 4 {
			t.Errorf("%s: block size %d", tc.name, s.BlockSize())
		}
	}
}

// An engine whose every stored block names an unknown parent (older SGLang's content-only
// hashes) is unindexable — not healthy, so routing uses the approximate index — until blocks
// chain from the root again.
func TestUnindexableEngine(t *testing.T) {
	s := &Subscriber{Worker: "w", Model: "m", Index: NewIndex(1000), Log: slog.New(slog.DiscardHandler)}
	orphan := func(h uint64) Event {
		return Event{Kind: KindStored, Hashes: []uint64{h}, Parent: 7, HasParent: true, Tokens: []uint32{1, 2}, BlockSize: 2, Group: -1}
	}
	for i := 0; i < unindexableAfter-1; i++ {
		s.apply(Batch{Events: []Event{orphan(uint64(100 + i))}})
	}
	if st := s.Stats(); st.Unindexable || !st.Healthy {
		t.Fatalf("after %d orphans: %+v", unindexableAfter-1, st)
	}
	s.apply(Batch{Events: []Event{orphan(99)}})
	if st := s.Stats(); !st.Unindexable || st.Healthy {
		t.Fatalf("after %d orphans: %+v", unindexableAfter, st)
	}
	s.apply(Batch{Events: []Event{{Kind: KindStored, Hashes: []uint64{1}, Tokens: []uint32{1, 2}, BlockSize: 2, Group: -1}}})
	if st := s.Stats(); st.Unindexable || !st.Healthy {
		t.Fatalf("after a root block: %+v", st)
	}
}
