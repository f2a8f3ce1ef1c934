package proxy

import (
	"bytes"
	"errors"
	"io"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"
)

// TestReadBodyWhateverItsDeclaredLength: an answer reads whole and unchanged whether its
// declared length is right, unknown, short or long of the truth, in reads of any size; an error
// mid-answer is returned; past MaxRewriteBody it is ErrBodyTooLarge, whatever length it declared.
func TestReadBodyWhateverItsDeclaredLength(t *testing.T) {
	body := strings.Repeat("0123456789", 230) // 2,300 bytes: past the undeclared first buffer
	for _, size := range []int64{-1, 0, 1, 511, 512, 2299, 2300, 2301, 1 << 20, MaxRewriteBody + 5} {
		for name, r := range map[string]io.Reader{"whole": strings.NewReader(body), "byte by byte": iotest.OneByteReader(strings.NewReader(body)),
			"data with EOF": iotest.DataErrReader(strings.NewReader(body))} {
			got, err := ReadBody(r, size)
			if err != nil || string(got) != body {
				t.Fatalf("size %d, %s: %d bytes, %v; want the %d bytes", size, name, len(got), err, len(body))
			}
		}
	}
	cut := errors.New("cut")
	if _, err := ReadBody(io.MultiReader(strings.NewReader("abc"), iotest.ErrReader(cut)), 10); !errors.Is(err, cut) {
		t.Fatalf("a cut answer: %v, want its error", err)
	}
	for _, size := range []int64{-1, 100, MaxRewriteBody, MaxRewriteBody + 1} {
		big := io.LimitReader(zeros{}, MaxRewriteBody+1)
		if b, err := ReadBody(big, size); !errors.Is(err, ErrBodyTooLarge) || b != nil {
			t.Fatalf("declared %d, one byte past the bound: %d bytes, %v; want ErrBodyTooLarge", size, len(b), err)
		}
	}
	if b, err := ReadBody(io.LimitReader(zeros{}, MaxRewriteBody), MaxRewriteBody); err != nil || len(b) != MaxRewriteBody || !bytes.Equal(b[:4], []byte{0, 0, 0, 0}) {
		t.Fatalf("exactly the bound: %d bytes, %v", len(b), err)
	}
}

// TestReadBodyDoesNotTakeTheDeclaredLengthsWord: an engine that declares 60 MiB and sends ten
// bytes makes ReadBody allocate what came (and its first buffer's bound), not what it declared.
func TestReadBodyDoesNotTakeTheDeclaredLengthsWord(t *testing.T) {
	for _, size := range []int64{60 << 20, MaxRewriteBody, 1 << 62} {
		bytes0 := heapAllocated()
		got, err := ReadBody(strings.NewReader("0123456789"), size)
		grew := heapAllocated() - bytes0
		if err != nil || string(got) != "0123456789" {
			t.Fatalf("declared %d: %q, %v", size, got, err)
		}
		if grew > 2*maxFirstBuffer {
			t.Fatalf("declared %d, sent 10 bytes: %d bytes allocated, bound %d", size, grew, maxFirstBuffer)
		}
	}
}

// heapAllocated is the bytes this process has allocated so far.
func heapAllocated() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.TotalAlloc
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
