package pd

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/ssetest"
)

// clientData is what an SSE client dispatches from a whole stream, a leading U+FEFF stripped
// as the HTML Living Standard's decoder strips it.
func clientData(stream []byte) []string {
	return ssetest.Dispatched(bytes.TrimPrefix(stream, []byte("\xEF\xBB\xBF")))
}

// A decode stream relayed as the PD path relays it: split by openai.EventReader, each event
// through checkedEvent. Every usage a client's JSON parser reads from a dispatched event (JSON
// allows whitespace before a value; JSON.parse and json.loads accept it) reaches the check, here
// a recompute (cached_tokens 0 of 100) whose event's payload begins with whitespace ("data:" and
// two spaces, a tab, an empty first data line), or a stream that begins with a UTF-8 byte order
// mark, which a client strips. Each of these used to pass the check by.
func TestARecomputeCannotHideBehindWhitespaceOrABOM(t *testing.T) {
	const received = `{"id":"c","choices":[{"index":0,"text":"y"}],"usage":{"prompt_tokens":100,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":99}}}`
	const recomputed = `{"id":"c","choices":[],"usage":{"prompt_tokens":100,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}`
	for name, stream := range map[string]string{
		"two spaces after data:": "data: " + received + "\n\ndata:  " + recomputed + "\n\ndata: [DONE]\n\n",
		"a tab after data:":      "data: " + received + "\n\ndata:\t" + recomputed + "\n\ndata: [DONE]\n\n",
		"an empty data line":     "data: " + received + "\n\ndata:\ndata: " + recomputed + "\n\ndata: [DONE]\n\n",
		"a BOM at the start":     "\xEF\xBB\xBFdata: " + recomputed + "\n\ndata: [DONE]\n\n",
	} {
		t.Run(name, func(t *testing.T) {
			// what a client reads: the recompute
			sawRecompute := false
			for _, d := range clientData([]byte(stream)) {
				var v struct {
					Usage *struct {
						Prompt  int `json:"prompt_tokens"`
						Details struct {
							Cached int `json:"cached_tokens"`
						} `json:"prompt_tokens_details"`
					} `json:"usage"`
				}
				if json.Unmarshal([]byte(d), &v) == nil && v.Usage != nil && v.Usage.Details.Cached == 0 {
					sawRecompute = true
				}
			}
			if !sawRecompute {
				t.Fatalf("test stream broken: a client reads no recompute in %q", stream)
			}
			// what Baton's check reads
			var c kvCheck
			pu := prefillUsage{prompt: 100, cached: 40, ok: true}
			check := checkedEvent(&c, pu)
			er := openai.NewEventReader(strings.NewReader(stream))
			var relayed bytes.Buffer
			for {
				ev, err := er.Next()
				if len(ev) > 0 {
					relayed.Write(check(ev))
				}
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			if !c.recomputed() {
				t.Errorf("a client reads cached_tokens 0 of 100, Baton's verdict is %q; the client receives %q", c.verdict(), relayed.String())
			}
		})
	}
}

// JSON.parse (openai-node) reads 1e2 as 100 and 0.0 as 0, as it reads 100 and 0 (and Python's
// SDK reads a whole float as its int): a usage whose counts are spelled so says the same
// recompute, and the check reads it so. It used to read only an integer's plain spelling, and
// said "unknown".
func TestARecomputeCannotHideInANumbersSpelling(t *testing.T) {
	for _, usage := range []string{
		`{"prompt_tokens":1e2,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}`,
		`{"prompt_tokens":100,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0.0}}`,
		`{"prompt_tokens":100.0,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}`,
	} {
		var c kvCheck
		checkEvent([]byte(`data: {"id":"c","choices":[],"usage":`+usage+"}\n\n"), &c, prefillUsage{})
		if !c.recomputed() {
			t.Errorf("usage %s (prompt 100, cached 0 to a JavaScript client): verdict %q", usage, c.verdict())
		}
	}
}

// jsonNumber is JSON's number grammar, as encoding/json's validator reads it; wholeNumber reads
// the value a float parser does, where it is a whole number within 2^53.
func FuzzWholeNumber(f *testing.F) {
	for _, s := range []string{"1e2", "100.0", "-0.0", "0", "01", "1.", ".5", "1e", "1e+3", "-", "1E-0", "9007199254740993.0", "1.5", "0x10", "Inf", "1_0"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		isNumber := json.Valid(b) && len(b) > 0 && (b[0] == '-' || (b[0] >= '0' && b[0] <= '9')) && !bytes.ContainsAny(b, " \t\r\n")
		if jsonNumber(b) != isNumber {
			t.Fatalf("jsonNumber(%q) = %v, JSON's grammar says %v", b, !isNumber, isNumber)
		}
		n, ok := wholeNumber(b)
		if !isNumber {
			if ok {
				t.Fatalf("wholeNumber(%q) read %d from what is no JSON number", b, n)
			}
			return
		}
		var v float64
		if err := json.Unmarshal(b, &v); err != nil {
			return // out of float64's range
		}
		if want := v == math.Trunc(v) && math.Abs(v) <= 1<<53; ok != want || (ok && float64(n) != v) {
			t.Fatalf("wholeNumber(%q) = %d %v; the value is %v", b, n, ok, v)
		}
	})
}
