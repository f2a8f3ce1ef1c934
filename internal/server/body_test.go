package server

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"testing/iotest"
)

func TestReadAll(t *testing.T) {
	for _, size := range []int{0, 1, 1000, initialBodyBuffer - 1, initialBodyBuffer, initialBodyBuffer + 1, 100 << 10, 1 << 20} {
		want := bytes.Repeat([]byte("abcdefg"), size/7+1)[:size]
		for _, claimed := range []int64{int64(size), -1} {
			for name, r := range map[string]io.Reader{"whole": bytes.NewReader(want), "byte by byte": iotest.OneByteReader(bytes.NewReader(want))} {
				if size > 200<<10 && name == "byte by byte" {
					continue
				}
				got, err := readAll(r, claimed, reserveAll)
				if err != nil || !bytes.Equal(got, want) {
					t.Fatalf("size %d claimed %d %s: %d bytes, %v", size, claimed, name, len(got), err)
				}
			}
		}
	}
	// A body shorter than its claim is copied out of the pooled buffer, which is then reused.
	a, _ := readAll(strings.NewReader("short"), 1<<20, reserveAll)
	b, _ := readAll(strings.NewReader("other"), 1<<20, reserveAll)
	if string(a) != "short" || string(b) != "other" {
		t.Errorf("got %q and %q", a, b)
	}
}

// A large claim followed by a few bytes costs what arrived, not what was claimed.
func TestReadAllDoesNotTrustTheClaim(t *testing.T) {
	allocs := testing.AllocsPerRun(20, func() { readAll(iotest.ErrReader(io.ErrUnexpectedEOF), 536870000, reserveAll) })
	var sink []byte
	bytesPer := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			sink, _ = readAll(io.MultiReader(strings.NewReader(`{"m`), iotest.ErrReader(io.ErrUnexpectedEOF)), 536870000, reserveAll)
		}
	}).AllocedBytesPerOp()
	_ = sink
	if allocs > 2 || bytesPer > 1<<20 {
		t.Errorf("a 512 MB claim with 3 bytes allocated %v times, %d bytes per read", allocs, bytesPer)
	}
}

// reserveAll reserves whatever is asked.
func reserveAll(int) bool { return true }

// The body budget counts what is live: while a buffer is copied into the one it grows into,
// both are held, so the reservation covers both and the old one is given back after. Counting
// only the growth let six held bodies take about twice the budget.
func TestReadAllReservesBothBuffersWhileGrowing(t *testing.T) {
	for _, claimed := range []int64{0, 10 << 20} {
		var held, peak int
		body := bytes.Repeat([]byte("x"), 10<<20)
		got, err := readAll(bytes.NewReader(body), claimed, func(n int) bool {
			held += n
			peak = max(peak, held)
			return true
		})
		if err != nil || len(got) != len(body) {
			t.Fatalf("claim %d: %d bytes, %v", claimed, len(got), err)
		}
		if held != cap(got) && claimed == 0 {
			t.Errorf("claim %d: %d bytes reserved at the end for a %d-byte buffer", claimed, held, cap(got))
		}
		// The last growth copied at least half the body into a buffer of at least its size.
		if peak < len(body)+len(body)/2 {
			t.Errorf("claim %d: at most %d bytes reserved; the last growth held %d at once", claimed, peak, len(body)+len(body)/2)
		}
	}
}
