package epp

import "testing"

// Memory goes back after a burst that a small epp_max_streams allows (half of it), and after
// bodies of 64 MiB or more were let go however few the exchanges; not after a handful.
func TestMemoryGivenBackAfterBursts(t *testing.T) {
	for _, c := range []struct {
		name      string
		max, open int
		freed     int64
		want      bool
	}{
		{"a burst of half a small bound", 20, 10, 0, true},
		{"a handful", 1024, 10, 0, false},
		{"few exchanges, many body bytes", 1024, 3, 64 << 20, true},
	} {
		s := &Server{MaxStreams: c.max}
		for i := 0; i < c.open; i++ {
			s.started()
		}
		s.freed.Store(c.freed)
		for i := 0; i < c.open; i++ {
			s.ended()
		}
		if got := s.released.Load() != 0; got != c.want {
			t.Errorf("%s: released %v, want %v", c.name, got, c.want)
		}
	}
}
