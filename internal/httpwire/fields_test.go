package httpwire

import (
	"net/http"
	"testing"
)

// A header built by Fields is the header net/http would build from the same lines: names
// matched in any case to their canonical form, values kept whole, a repeated name's values in
// order — and appending to one name's values never changes another's (they share a backing
// array).
func TestFieldsBuildTheHeaderNetHTTPWould(t *testing.T) {
	n := NewNames([]string{"Content-Type", "Date"}, []string{"application/json"}, []string{"Date"})
	f := NewFields(2)
	lines := [][2]string{{"content-TYPE", "application/json"}, {"date", "Wed, 02 Dec 2026 22:00:00 GMT"}, {"x-trace", "a"},
		{"X-Trace", "b"}, {"via", "1.1 p"}, {"Accept", "*/*"}}
	want := http.Header{}
	for _, l := range lines {
		k := n.Key([]byte(l[0]))
		f.Add(k, n.Value(k, []byte(l[1])))
		want.Add(l[0], l[1])
	}
	for k, v := range want {
		if got := f.H[k]; len(got) != len(v) || len(v) > 0 && (got[0] != v[0] || got[len(got)-1] != v[len(v)-1]) {
			t.Errorf("%s: %q, want %q", k, got, v)
		}
	}
	if len(f.H) != len(want) {
		t.Errorf("%d names, want %d: %v", len(f.H), len(want), f.H)
	}
	f.H["Via"] = append(f.H["Via"], "1.1 q")
	f.H["Content-Type"][0] = "text/plain"
	if f.H["Accept"][0] != "*/*" || f.H["Date"][0] != "Wed, 02 Dec 2026 22:00:00 GMT" || f.H["Via"][0] != "1.1 p" {
		t.Errorf("changing one name's values changed another's: %v", f.H)
	}
	// A recent value is shared while it stays the same, and follows it when it changes.
	a, b := n.Value("Date", []byte("D1")), n.Value("Date", []byte("D1"))
	if a != "D1" || b != "D1" || n.Value("Date", []byte("D2")) != "D2" || n.Value("Date", []byte("D1")) != "D1" {
		t.Error("a recent value read wrong")
	}
}

func BenchmarkFields(b *testing.B) {
	n := NewNames([]string{"Content-Type", "Content-Length", "Date", "Server"}, []string{"application/json", "uvicorn"}, []string{"Date"})
	lines := [][2][]byte{{[]byte("content-type"), []byte("application/json")}, {[]byte("content-length"), []byte("312")},
		{[]byte("date"), []byte("Wed, 02 Dec 2026 22:00:00 GMT")}, {[]byte("server"), []byte("uvicorn")}}
	b.ReportAllocs()
	for b.Loop() {
		f := NewFields(8)
		for _, l := range lines {
			k := n.Key(l[0])
			f.Add(k, n.Value(k, l[1]))
		}
	}
}
