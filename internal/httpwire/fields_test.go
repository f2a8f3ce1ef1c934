package httpwire

import (
	"net/http"
	"strings"
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

// A Recall gives every field the name and value Names would (net/http's canonical name, the
// exact value), whatever the last head was — the same fields, others, another order, more than
// it keeps — and the second of two identical heads allocates nothing for them.
func TestRecallGivesWhatNamesWouldAndSharesRepeats(t *testing.T) {
	n := NewNames([]string{"Content-Type", "Date"}, []string{"application/json"}, []string{"Date"})
	heads := [][][2]string{
		{{"content-type", "application/json"}, {"x-engine-id", "vllm-1"}, {"X-KV-Source", "remote"}, {"x-request-id", "a"}},
		{{"content-type", "application/json"}, {"x-engine-id", "vllm-1"}, {"X-KV-Source", "remote"}, {"x-request-id", "b"}},
		{{"X-KV-Source", "recompute"}, {"x-engine-id", "vllm-2"}, {"x-kv-source", "remote"}},
		{{"a", "1"}, {"b", "2"}, {"c", "3"}, {"d", "4"}, {"e", "5"}, {"f", "6"}, {"g", "7"}, {"h", "8"}, {"i", "9"}, {"x-engine-id", "vllm-2"}},
		{{"x-engine-id", "vllm-2"}, {"i", "9"}},
		{{"x-long", strings.Repeat("v", 4096)}, {"x-engine-id", "vllm-2"}},
		{{"x-long", strings.Repeat("v", 4096)}, {"x-engine-id", "vllm-2"}},
	}
	var r Recall
	for hi, h := range heads {
		for i, f := range h {
			k, v := r.Field(n, i, []byte(f[0]), []byte(f[1]))
			if k != http.CanonicalHeaderKey(f[0]) || v != f[1] {
				t.Fatalf("head %d field %d (%s: %s): got %q: %q", hi, i, f[0], f[1], k, v)
			}
		}
	}
	// What it keeps is small: a long value of the last head is not held.
	if r.f[0].v != "" || r.f[1].v != "vllm-2" {
		t.Errorf("a Recall keeps %q, %q", r.f[0].k, r.f[1].v)
	}
	head := heads[1]
	lines := make([][2][]byte, len(head))
	for i, f := range head[:3] { // the id changes on every answer: the others repeat
		lines[i] = [2][]byte{[]byte(f[0]), []byte(f[1])}
	}
	lines = lines[:3]
	var fresh Recall
	for i, l := range lines {
		fresh.Field(n, i, l[0], l[1])
	}
	if a := testing.AllocsPerRun(100, func() {
		for i, l := range lines {
			fresh.Field(n, i, l[0], l[1])
		}
	}); a != 0 {
		t.Errorf("a repeated head allocated %v times", a)
	}
}

// A peer whose heads Names covers costs its connection no Recall; the first name it lacks makes
// one, and fields read through either give what Names would.
func TestRecallIsMadeOnlyForNamesNamesLacks(t *testing.T) {
	n := NewNames([]string{"Content-Type", "Date", "X-Request-Id"}, []string{"application/json"}, []string{"Date"})
	var r *Recall
	for i, f := range [][2]string{{"content-type", "application/json"}, {"date", "D1"}, {"x-request-id", "abc"}} {
		if k, v := RecallField(n, &r, i, []byte(f[0]), []byte(f[1])); k != http.CanonicalHeaderKey(f[0]) || v != f[1] {
			t.Errorf("%s: %q: %q", f[0], k, v)
		}
	}
	if r != nil {
		t.Fatal("a head Names covers made a Recall")
	}
	if k, v := RecallField(n, &r, 3, []byte("x-engine-id"), []byte("e1")); k != "X-Engine-Id" || v != "e1" || r == nil {
		t.Errorf("an engine's own name: %q: %q, recall made %v", k, v, r != nil)
	}
}
