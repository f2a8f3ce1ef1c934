package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// An answer's id is read where vLLM puts it — the first key of a JSON answer or of a stream's
// first event — and nowhere else; an id Baton cannot read plainly is no id, and bytes that could
// still begin with one are not judged yet.
func TestAnswerID(t *testing.T) {
	for in, want := range map[string]struct {
		id string
		v  idVerdict
	}{
		`{"id":"chatcmpl-abc","object":"chat.completion"}`:  {"chatcmpl-abc", idFound},
		`{"id": "cmpl-x-retry-2","choices":[]}`:             {"cmpl-x-retry-2", idFound},
		"data: {\"id\":\"cmpl-7\",\"choices\":[]}\n\n":      {"cmpl-7", idFound},
		"\r\ndata:{\"id\":\"chatcmpl-8\"}\n\n":              {"chatcmpl-8", idFound},
		`{"object":"text_completion","id":"cmpl-late"}`:     {"", idNone},
		`{"id":"cmpl-\"quoted\""}`:                          {`cmpl-"quoted"`, idFound},
		`{"id":"cmpl-a\u003cb\\c"}`:                         {`cmpl-a<b\c`, idFound},
		`{"id":"cmpl-bad\q"}`:                               {"", idNone},
		`{"id":"cmpl-a\`:                                    {"", idIncomplete},
		`{"id":"cmpl-unterminated`:                          {"", idIncomplete},
		`{"error":{"message":"x"}}`:                         {"", idNone},
		`data: {"error":{"message":"x"}}`:                   {"", idError},
		`data: {"object":"error","message":"x"}`:            {"", idError},
		": keep-alive\n\ndata: {\"id\":\"cmpl-after\"}\n\n": {"cmpl-after", idFound},
		": keep-alive\r\n\r\n: keep-alive\n\nevent: x\nid: 3\nretry: 9\ndata: {\"id\":\"cmpl-k\"}": {"cmpl-k", idFound},
		": keep-al":          {"", idIncomplete},
		": keep-alive\n\nda": {"", idIncomplete},
		strings.Repeat(": keep-alive\n\n", leadWindow/14+1) + "data: {\"id\":\"cmpl-late\"}": {"", idNone},
		": " + strings.Repeat("x", leadWindow):                                               {"", idNone},
		``:                                                                                   {"", idIncomplete},
		`  `:                                                                                 {"", idIncomplete},
		`da`:                                                                                 {"", idIncomplete},
		`data: `:                                                                             {"", idIncomplete},
		`{`:                                                                                  {"", idIncomplete},
		`{"i`:                                                                                {"", idIncomplete},
		`{"id"`:                                                                              {"", idIncomplete},
		`{"id": `:                                                                            {"", idIncomplete},
		`{"o`:                                                                                {"", idIncomplete},
		`{"ok":1}`:                                                                           {"", idNone},
		`[1]`:                                                                                {"", idNone},
		`{"id":"` + strings.Repeat("x", 600) + `"`: {"", idNone},
	} {
		id, v := answerID([]byte(in))
		if string(id) != want.id || v != want.v {
			t.Errorf("answerID(%q) = %q, %d; want %q, %d", in, id, v, want.id, want.v)
		}
	}
}

// oneByteViewer lends its answer a byte per view, in one buffer it overwrites on every call, as
// Baton's client lends its read buffer.
type oneByteViewer struct {
	io.ReadCloser
	rest string
	buf  [1]byte
}

func (v *oneByteViewer) Next() ([]byte, error) {
	if v.rest == "" {
		return nil, io.EOF
	}
	v.buf[0], v.rest = v.rest[0], v.rest[1:]
	return v.buf[:], nil
}

// readProven reads body through a prover for the request id req-1 on a completions route, over
// a reader of a byte at a time (whichever way a body is read: Read, or views).
func readProven(t *testing.T, w *worker.Worker, body string, views bool) (string, error) {
	t.Helper()
	pr := &prover{ReadCloser: io.NopCloser(iotest.OneByteReader(strings.NewReader(body))), p: &Proxy{}, w: w, proof: w.Proof(), sent: "req-1", prefix: "cmpl-"}
	if !views {
		b, err := io.ReadAll(pr)
		return string(b), err
	}
	v := &oneByteViewer{ReadCloser: io.NopCloser(nil), rest: body}
	pv := &provingViewer{prover: prover{ReadCloser: v, p: &Proxy{}, w: w, proof: w.Proof(), sent: "req-1", prefix: "cmpl-"}, v: v}
	var out []byte
	for {
		b, err := pv.Next()
		out = append(out, b...)
		if err == io.EOF {
			return string(out), nil
		}
		if err != nil {
			return string(out), err
		}
	}
}

// A worker whose engine names its answers after the request is judged on the id its answer
// begins with however the first bytes arrive (a byte per read here): its own answer reaches the
// relay whole; one named after another request, one that does not begin with an id (another key
// order, empty, a whole 200 that is an error object) gives the relay nothing and fails as
// ErrAnotherAnswer; a stream whose first event is an error is not judged. A worker not yet proven is not judged, and is proven by its first answer named after
// the request.
func TestAProvenWorkerIsJudgedByItsAnswersFirstBytes(t *testing.T) {
	for _, views := range []bool{false, true} {
		proven := worker.New(config.Worker{URL: "http://proven"})
		proven.NoteIDEcho()
		for body, refused := range map[string]bool{
			`{"id":"cmpl-req-1","choices":[{"text":"mine"}]}`:                  false,
			`{"id": "cmpl-req-1","choices":[]}`:                                false,
			"data: {\"id\":\"cmpl-req-1\",\"choices\":[]}\n\ndata: [DONE]\n\n": false,
			`{"error":{"message":"bad","code":400}}`:                           true,
			"data: {\"object\":\"error\",\"message\":\"x\"}\n\n":               false,
			`{"id":"cmpl-req-0","choices":[{"text":"another's"}]}`:             true,
			"data: {\"id\":\"cmpl-req-0\",\"choices\":[]}\n\n":                 true,
			`{"id":"chatcmpl-req-1","choices":[]}`:                             true,
			`{"object":"text_completion","id":"cmpl-req-0"}`:                   true,
			`{"choices":[{"text":"no id"}]}`:                                   true,
			``:                                                                 true,
			`{"id":"cmpl-req-1`:                                                true,
			// vLLM's --sse-keep-alive-interval: comments before the first token, a few hundred
			// bytes of them past the id's own window.
			strings.Repeat(": keep-alive\n\n", 80) + "data: {\"id\":\"cmpl-req-1\",\"choices\":[]}\n\ndata: [DONE]\n\n": false,
			strings.Repeat(": keep-alive\n\n", 80) + "data: {\"id\":\"cmpl-req-0\",\"choices\":[]}\n\n":                 true,
			`{"id":"` + strings.Repeat("cmpl-", 200) + `"}`:                                                             true,
		} {
			got, err := readProven(t, proven, body, views)
			switch {
			case refused && (!errors.Is(err, ErrAnotherAnswer) || got != ""):
				t.Errorf("views %v, %q: relayed %q, %v; want nothing, ErrAnotherAnswer", views, body, got, err)
			case !refused && (err != nil || got != body):
				t.Errorf("views %v, %q: relayed %q, %v; want it whole", views, body, got, err)
			}
		}
		fresh := worker.New(config.Worker{URL: "http://fresh"})
		for _, body := range []string{`{"object":"x"}`, `{"id":"cmpl-req-0"}`, ``} {
			if got, err := readProven(t, fresh, body, views); err != nil || got != body {
				t.Errorf("views %v, a worker not proven: %q relayed as %q, %v", views, body, got, err)
			}
		}
		if fresh.IDEchoes() {
			t.Fatal("proven by answers not named after the request")
		}
		if _, err := readProven(t, fresh, `{"id":"cmpl-req-1"}`, views); err != nil || !fresh.IDEchoes() {
			t.Errorf("views %v: an answer named after the request did not prove its worker (%v)", views, err)
		}
	}
}

// A request id holding what JSON escapes (a client's X-Request-Id may hold " and \; an engine
// may escape < > & too) is read as the engine meant it: the answer named after it is the
// request's, never refused as another's (which would fail a healthy worker's every attempt).
func TestAnEscapedIDIsTheRequestsOwn(t *testing.T) {
	proven := worker.New(config.Worker{URL: "http://proven"})
	proven.NoteIDEcho()
	for _, views := range []bool{false, true} {
		for _, body := range []string{`{"id":"cmpl-a\"b\\c<d>&","choices":[]}`, `{"id":"cmpl-a\"b\\c\u003cd\u003e\u0026","choices":[]}`} {
			pr := &prover{ReadCloser: io.NopCloser(iotest.OneByteReader(strings.NewReader(body))), p: &Proxy{}, w: proven, sent: `a"b\c<d>&`, prefix: "cmpl-"}
			var got []byte
			var err error
			if views {
				v := &oneByteViewer{ReadCloser: io.NopCloser(nil), rest: body}
				pv := &provingViewer{prover: prover{ReadCloser: v, p: &Proxy{}, w: proven, sent: `a"b\c<d>&`, prefix: "cmpl-"}, v: v}
				for {
					b, e := pv.Next()
					got = append(got, b...)
					if e != nil {
						if e != io.EOF {
							err = e
						}
						break
					}
				}
			} else {
				got, err = io.ReadAll(pr)
			}
			if err != nil || string(got) != body {
				t.Errorf("views %v, %s: relayed %q, %v", views, body, got, err)
			}
		}
	}
}

// failingReader gives its bytes, then fails with err.
type failingReader struct {
	b   string
	err error
}

func (r *failingReader) Read(p []byte) (int, error) {
	if r.b == "" {
		return 0, r.err
	}
	n := copy(p, r.b)
	r.b = r.b[n:]
	return n, nil
}

// An answer that fails before its id is whole (the client left, the deadline passed, the engine
// went after its head) fails as what it is — never as another request's answer, which would
// accuse the worker and count a mismatch.
func TestAnAnswerFailingBeforeItsIDIsNoMismatch(t *testing.T) {
	proven := worker.New(config.Worker{URL: "http://proven"})
	proven.NoteIDEcho()
	for _, cause := range []error{context.Canceled, context.DeadlineExceeded, io.ErrUnexpectedEOF} {
		for _, first := range []string{"", "data: {\"i", `{"id":"cmpl-re`} {
			pr := &prover{ReadCloser: io.NopCloser(&failingReader{b: first, err: cause}), p: &Proxy{}, w: proven, sent: "req-1", prefix: "cmpl-"}
			_, err := io.ReadAll(pr)
			if !errors.Is(err, cause) || errors.Is(err, ErrAnotherAnswer) {
				t.Errorf("%q then %v: %v", first, cause, err)
			}
		}
	}
}

// endTracker is an answer body of known length that notes whether its last byte was read before
// it was closed: the read that ends a body hands its connection back to the client's pool, and an
// answer out of step must close the connection instead.
type endTracker struct {
	r                io.Reader
	left             int
	closed, endFirst bool
}

func (e *endTracker) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	e.left -= n
	if e.left == 0 {
		e.endFirst = e.endFirst || !e.closed
		err = io.EOF
	}
	return n, err
}

func (e *endTracker) Close() error { e.closed = true; return nil }

// An answer out of step of known length is judged before its last byte is read, so that its
// connection is closed rather than handed back to the pool by the read that ends it — however
// large the reads, and whether the answer fits one; an answer that is its request's is read
// whole.
func TestAnAnswerOutOfStepIsJudgedBeforeItsEnd(t *testing.T) {
	proven := worker.New(config.Worker{URL: "http://proven"})
	proven.NoteIDEcho()
	for _, tc := range []struct {
		body    string
		refused bool
	}{
		{`{"id":"cmpl-req-0","choices":[{"text":"another's"}]}`, true},
		{`{"id":"cmpl-req-0"}`, true},
		{`{"choices":[]}`, true},
		{`{"id":"cmpl-req-1","choices":[{"text":"mine"}]}`, false},
	} {
		for _, size := range []int{1, 7, 64, 4096} {
			e := &endTracker{r: strings.NewReader(tc.body), left: len(tc.body)}
			pr := &prover{ReadCloser: e, p: &Proxy{}, w: proven, proof: proven.Proof(), sent: "req-1", prefix: "cmpl-", left: int64(len(tc.body))}
			var out []byte
			var err error
			buf := make([]byte, size)
			for {
				var n int
				n, err = pr.Read(buf)
				out = append(out, buf[:n]...)
				if err != nil {
					break
				}
			}
			switch {
			case tc.refused && (!errors.Is(err, ErrAnotherAnswer) || e.endFirst || !e.closed):
				t.Errorf("%q, reads of %d: %v, its end read before it was closed %v, closed %v", tc.body, size, err, e.endFirst, e.closed)
			case !tc.refused && (err != io.EOF || string(out) != tc.body):
				t.Errorf("%q, reads of %d: relayed %q, %v", tc.body, size, out, err)
			}
		}
	}
}

// An answer is judged by its worker's proof as it stood when its request was sent: a worker
// judged anew while the answer was on its way (its circuit opened) still has it judged, by the
// header or by its id.
func TestAnAnswerUnderWayIsJudgedAsItsWorkerWasProvenWhenSent(t *testing.T) {
	for _, byHeader := range []bool{true, false} {
		w := worker.New(config.Worker{URL: "http://proven", Runtime: config.RuntimeVLLM})
		if byHeader {
			w.NoteEcho()
		} else {
			w.NoteIDEcho()
		}
		proof := w.Proof()
		w.ForgetCorrelation() // judged anew while the answer is under way
		body := `{"id":"cmpl-req-0","choices":[{"text":"another's"}]}`
		out := httptest.NewRequest(http.MethodPost, "http://proven/v1/completions", nil)
		out.Header.Set("X-Request-Id", "req-1")
		resp := &http.Response{StatusCode: 200, Header: http.Header{"X-Request-Id": {"req-0"}}, Body: io.NopCloser(strings.NewReader(body)), ContentLength: int64(len(body))}
		if !byHeader {
			resp.Header = http.Header{}
		}
		got, err := (&Proxy{}).correlate(out, true, w, proof, resp, nil)
		if err == nil {
			var b []byte
			b, err = io.ReadAll(got.Body)
			if err == nil {
				t.Errorf("by header %v: another request's answer relayed: %s", byHeader, b)
			}
		}
		if !errors.Is(err, ErrAnotherAnswer) {
			t.Errorf("by header %v: %v, want ErrAnotherAnswer", byHeader, err)
		}
	}
}

// noReuseBody records whether its connection was kept from reuse.
type noReuseBody struct {
	io.Reader
	kept bool
}

func (b *noReuseBody) Close() error { return nil }
func (b *noReuseBody) NoReuse()     { b.kept = true }

// A stream whose first event is an error names no request: on a worker proven by its answers'
// ids, as an error answer, its connection carries nothing more; a stream that names its request
// keeps it.
func TestAnErrorEventKeepsItsConnectionFromReuse(t *testing.T) {
	w := worker.New(config.Worker{URL: "http://proven", Runtime: config.RuntimeVLLM})
	w.NoteIDEcho()
	for body, kept := range map[string]bool{
		"data: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n": true,
		"data: {\"id\":\"cmpl-req-1\",\"choices\":[]}\n\n":          false,
	} {
		b := &noReuseBody{Reader: strings.NewReader(body)}
		out := httptest.NewRequest(http.MethodPost, "http://proven/v1/completions", nil)
		out.Header.Set("X-Request-Id", "req-1")
		resp := &http.Response{StatusCode: 200, Header: http.Header{}, Body: b, ContentLength: -1}
		got, err := (&Proxy{}).correlate(out, true, w, w.Proof(), resp, nil)
		if err == nil {
			_, err = io.ReadAll(got.Body)
		}
		if err != nil || b.kept != kept {
			t.Errorf("%q: %v, kept from reuse %v, want %v", body, err, b.kept, kept)
		}
	}
}

// A stream that waited long for its first token — tens of thousands of vLLM keep-alive
// comments first — is judged by its id and relayed, its comments dropped past a bound; one
// named after another request is refused all the same.
func TestALongWaitOfKeepAlivesIsJudged(t *testing.T) {
	for _, views := range []bool{false, true} {
		proven := worker.New(config.Worker{URL: "http://proven"})
		proven.NoteIDEcho()
		wait := strings.Repeat(": keep-alive\n\n", 3000) // about 42 KiB
		rest := "data: {\"id\":\"cmpl-req-1\",\"choices\":[]}\n\ndata: [DONE]\n\n"
		got, err := readProven(t, proven, wait+rest, views)
		if err != nil || !strings.HasSuffix(got, rest) || !strings.HasPrefix(got, ": keep-alive\n\n") || len(got) > len(rest)+leadWindow {
			t.Errorf("views %v: relayed %d bytes, %v; want the answer after at most %d bytes of its comments", views, len(got), err, leadWindow)
		}
		if got, err := readProven(t, proven, wait+strings.Replace(rest, "req-1", "req-0", 1), views); !errors.Is(err, ErrAnotherAnswer) || got != "" {
			t.Errorf("views %v: another request's answer after a long wait: %q, %v", views, got, err)
		}
	}
}
