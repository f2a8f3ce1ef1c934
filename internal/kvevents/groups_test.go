package kvevents

import "testing"

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
