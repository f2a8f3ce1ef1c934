package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/worker"
)

// ErrAnotherAnswer is an answer that is not the request's: named after another request's id
// than the one Baton sent (in its X-Request-Id, or in its id), or without the id its engine puts
// on every answer — an answer out of step on a reused connection (an engine, or something
// before it, that sent a request's answer twice or late). It is closed with its connection and
// never relayed: a failure of the worker's, retried before the client got a byte.
var ErrAnotherAnswer = errors.New("the worker's answer is not this request's (named after another request, or missing the id its engine names every answer with); the connection is closed")

// correlate proves an answer is its request's before a byte of it is relayed, where the worker's
// engine names its answers after the X-Request-Id Baton sent:
//
//   - in the answer's X-Request-Id (vLLM's --enable-request-id-headers): an engine once seen
//     echoing the id must echo this request's, and an answer naming another, or none, is closed
//     before its end — its connection with it, so that nothing that follows on it reaches another
//     request — and is ErrAnotherAnswer;
//   - else in the answer's id (vLLM's chatcmpl-<id> and cmpl-<id>, on the routes that build it):
//     an engine once seen doing so must begin every 200 of those routes with this request's id.
//     The first bytes are held (at most idWindow past the lines a stream may begin with) until they hold a whole leading id or cannot,
//     before the relay writes anything; an answer named after another request, or without the
//     leading id its engine writes first, ends the body with ErrAnotherAnswer (a failure before
//     the client's head: retried). An error (an answer that is not a 200, or a stream whose first
//     event is an error object) carries no id to judge it by: only the header proves those.
//
// A worker not seen doing either since it last registered (an engine that names answers its own
// way, or a proxy before it that sets its own id) is not judged: GET /workers says which are.
//
// The answer is judged by the worker's proof as it stood when the request was sent (proof): a
// worker judged anew meanwhile (its circuit opened) still has the answers already under way judged.
func (p *Proxy) correlate(out *http.Request, named bool, w *worker.Worker, proof worker.Proof, resp *http.Response, err error) (*http.Response, error) {
	if err != nil {
		return resp, err
	}
	sent := out.Header.Get(openai.HeaderRequestID)
	if sent == "" {
		return resp, nil
	}
	got := resp.Header.Get(openai.HeaderRequestID)
	switch {
	case got == sent:
		w.NoteEcho()
		return resp, nil
	case proof.ByHeader():
		// A worker that echoes every answer's id gave this one another id, or none: bytes that
		// are no answer of its to this request (a duplicate, or stray bytes read as an answer).
		resp.Body.Close() // before its end: the connection is closed, never reused
		p.mismatch(w, sent, got)
		return nil, ErrAnotherAnswer
	case resp.StatusCode != http.StatusOK:
		if proof.ByID() && !p.dontReuse(resp.Body) {
			// An error names no request (vLLM's ErrorResponse has no id): on a worker proven by
			// its answers' ids, its connection carries nothing more, so that a duplicate of it
			// never reaches another request.
			resp.Body = &closingIdle{ReadCloser: resp.Body, p: p, w: w}
		}
		return resp, nil
	}
	prefix := routes.Of(out.URL.Path).AnswerID
	if prefix == "" || !named {
		return resp, nil
	}
	pr := prover{ReadCloser: resp.Body, p: p, w: w, proof: proof, sent: sent, prefix: prefix, left: resp.ContentLength}
	if v, ok := resp.Body.(viewer); ok {
		resp.Body = &provingViewer{prover: pr, v: v} // one allocation for both
	} else {
		resp.Body = proving(pr)
	}
	return resp, nil
}

// Named reports a request to w on path, of body, sent with the id sent, whose answer its engine
// names after that id: a route whose answers carry an id, on an engine that names them after
// the id Baton chose (namedByBaton).
func Named(w *worker.Worker, path string, body []byte, sent string) bool {
	return routes.Of(path).AnswerID != "" && namedByBaton(w, path, body, sent)
}

// unprovable reports a request whose answer cannot be proven its own (not named, Named) though
// its worker's answers can be: the worker is proven by its answers' ids (not by the X-Request-Id
// header, which proves every answer) — a route whose answers carry none (/v1/responses,
// /v1/embeddings, …), an SGLang request of many samples. Such a request is sent on a connection
// of its own (Connection: close), so that no answer out of step on it reaches another request.
func unprovable(proof worker.Proof, named bool) bool {
	return proof.ByID() && !proof.ByHeader() && !named
}

// noReuser is an answer body whose connection can be kept from reuse (Baton's own client).
type noReuser interface{ NoReuse() }

// dontReuse keeps the connection the answer body b came on from being used again once b is
// read, and reports whether it could: Baton's own client closes it. Over net/http's transport,
// which cannot single a connection out, the caller closes the worker's idle connections when
// the body is closed (closingIdle) — a request that took that connection in between is judged
// by its own answer.
func (p *Proxy) dontReuse(b io.ReadCloser) bool {
	if v, ok := b.(noReuser); ok {
		v.NoReuse()
		return true
	}
	return false
}

// closingIdle is an answer body after which its worker's idle connections are closed.
type closingIdle struct {
	io.ReadCloser
	p *Proxy
	w *worker.Worker
}

func (c *closingIdle) Close() error {
	err := c.ReadCloser.Close()
	CloseIdle(c.p.Transport, c.w.URL)
	return err
}

// namedByBaton reports an answer whose id its engine is known to name after the id Baton chose
// for it, so that the answer may be judged by it and its worker proven by it: vLLM's, named
// after the X-Request-Id sent (its header wins over a client's request_id in the body,
// _base_request_id in vllm/entrypoints/openai/engine/serving.py), and SGLang's given Baton's own
// rid (openai.RIDFor), which its answer is named after exactly. Nothing else is: an engine of
// another kind, or an SGLang request of many samples (no rid), names its answers its own way, or
// after what a client put in its body — which must never prove, nor fail, a worker.
func namedByBaton(w *worker.Worker, path string, body []byte, sent string) bool {
	switch w.Runtime() {
	case config.RuntimeVLLM:
		return true
	case config.RuntimeSGLang:
		want, ok := openai.RIDFor(body, path, sent)
		got, has := openai.Get(body, "rid")
		return ok && has && bytes.Equal(got, want)
	}
	return false
}

// proving is pr on the heap (apart from correlate, where its address would put it there on
// every path, the viewer's too).
func proving(pr prover) *prover { return &pr }

func (p *Proxy) mismatch(w *worker.Worker, sent, got string) {
	if p.Log != nil {
		p.Log.Error("an answer for another request arrived on a connection to the worker: closed, not relayed", "worker", w.URL, "sent_request_id", sent, "answer_request_id", got)
	}
}

// idWindow bounds the first bytes of an answer read for its leading id (vLLM's ids are a prefix,
// the request id Baton sent, at most a few dozen bytes, and a stream's "data: ").
const idWindow = 512

// prover judges an answer by the id its first bytes begin with, before any of them is relayed.
type prover struct {
	io.ReadCloser
	p       *Proxy
	w       *worker.Worker
	proof   worker.Proof // the worker's when the request was sent
	sent    string
	prefix  string // the route's: chatcmpl- or cmpl-
	decided bool
	// closeIdle: the answer is an error event over net/http's transport, after which the
	// worker's idle connections are closed (dontReuse).
	closeIdle bool
	held      []byte // the first bytes, read while they could not be judged yet
	heldErr   error  // the read error that came with the last of them
	// left is what remains of a body of known length (-1: unknown) while it is not judged: its
	// last byte is not read before the verdict, for a client hands a connection back to its pool
	// with the read that ends its body, and an answer out of step must close it instead.
	left int64
}

// short is b, less the body's last byte while the answer is not judged (see left).
func (r *prover) short(b []byte) []byte {
	if r.left > 1 && int64(len(b)) >= r.left {
		return b[:r.left-1]
	}
	return b
}

// undecidedRead reads into b while the answer is not judged, keeping its last byte unread.
func (r *prover) undecidedRead(b []byte) (int, error) {
	n, err := r.ReadCloser.Read(r.short(b))
	if r.left > 0 {
		r.left -= int64(n)
	}
	return n, err
}

// judge decides on the first bytes b of the answer, read with rerr (the read that ended them,
// io.EOF at its end). It is undecided (false, nil) while b could still begin with a whole id.
func (r *prover) judge(b []byte, rerr error) (bool, error) {
	id, v := answerID(b)
	if v == idIncomplete && rerr == nil {
		return false, nil
	}
	r.decided = true
	switch {
	case v == idIncomplete && rerr != io.EOF:
		// The answer failed (the client left, the deadline passed, the engine went) before its id
		// was whole: its failure is what it is, no evidence of another request's answer.
		return true, nil
	case v == idError:
		if r.proof.ByID() && !r.p.dontReuse(r.ReadCloser) {
			r.closeIdle = true // an error event names no request: as an error answer
		}
		return true, nil // an error carries no id: not judged
	case v == idFound && len(id) == len(r.prefix)+len(r.sent) && string(id[:len(r.prefix)]) == r.prefix && string(id[len(r.prefix):]) == r.sent:
		r.w.NoteIDEcho()
		return true, nil
	case !r.proof.ByID():
		return true, nil // an engine not known to name its answers after the request
	}
	// A worker whose engine begins every answer with the request's id began this one with
	// another's, or with none: bytes that are no answer of its to this request.
	r.ReadCloser.Close() // before its end: the connection is closed, never reused
	if rerr == io.EOF {
		// The read that gave the last of these bytes ended the body (a chunked answer whose end
		// was already read: net/http's client ends the body with its last data), and the client
		// may have handed the connection back to its pool: the worker's idle connections go.
		CloseIdle(r.p.Transport, r.w.URL)
	}
	got := string(id)
	if v != idFound {
		got = "(none)"
	}
	r.p.mismatch(r.w, r.sent, got)
	return true, ErrAnotherAnswer
}

func (r *prover) Read(b []byte) (int, error) {
	if r.decided {
		if r.held == nil {
			return r.ReadCloser.Read(b)
		}
		n := copy(b, r.held)
		r.held = r.held[n:]
		if len(r.held) > 0 {
			return n, nil
		}
		r.held = nil
		return n, r.heldErr
	}
	n, err := r.undecidedRead(b)
	if n == 0 && err == nil {
		return 0, nil
	}
	ok, jerr := r.judge(b[:n], err)
	if jerr != nil {
		return 0, jerr
	}
	if ok {
		return n, err
	}
	// A first read too short to judge (a tiny first chunk, a split segment): hold it and read on.
	r.held = append(make([]byte, 0, idWindow), b[:n]...)
	for !ok {
		r.held = dropKeepAlives(r.held)
		if len(r.held) == cap(r.held) { // lines before the first data line (bounded: leadWindow)
			r.held = slices.Grow(r.held, idWindow)
		}
		m, err := r.undecidedRead(r.held[len(r.held):cap(r.held)])
		r.held = r.held[:len(r.held)+m]
		if ok, jerr = r.judge(r.held, err); jerr != nil {
			r.held = nil
			return 0, jerr
		}
		r.heldErr = err
	}
	return r.Read(b)
}

// Close closes the answer, and the worker's idle connections after an error event that could not
// be kept from reuse (closeIdle).
func (r *prover) Close() error {
	err := r.ReadCloser.Close()
	if r.closeIdle {
		CloseIdle(r.p.Transport, r.w.URL)
	}
	return err
}

// provingViewer is a prover over a body that lends views of its read buffer (Baton's client).
type provingViewer struct {
	prover
	v viewer
}

func (r *provingViewer) Next() ([]byte, error) {
	if r.decided && r.held == nil {
		return r.v.Next()
	}
	return r.first()
}

// first serves the first bytes: read and judged, or held while they could not be judged yet.
// (Apart from Next, so that a stream waits for its later events under a small frame.)
//
//go:noinline
func (r *provingViewer) first() ([]byte, error) {
	if r.decided {
		b, err := r.held, r.heldErr
		r.held = nil
		return b, err
	}
	b, err := r.v.Next()
	if len(b) == 0 && err == nil {
		return b, nil
	}
	ok, jerr := r.judge(b, err)
	if jerr != nil {
		return nil, jerr
	}
	if ok {
		return b, err
	}
	// The view is the client's buffer until the next call: hold a copy and read on.
	r.held = append(make([]byte, 0, idWindow), b...)
	for !ok {
		b, err = r.v.Next()
		r.held = append(dropKeepAlives(r.held), b...)
		if ok, jerr = r.judge(r.held, err); jerr != nil {
			r.held = nil
			return nil, jerr
		}
		r.heldErr = err
	}
	return r.first()
}

// leadWindow bounds the lines a stream may begin with before its first data line (comments and
// other fields), read to find the id: vLLM's --sse-keep-alive-interval writes a ": keep-alive"
// comment event while a stream waits for its first token (vllm/entrypoints/openai/
// sse_keep_alive.py), any number of them while a request queues: past half of it they are
// dropped (dropKeepAlives), so that only other fields can fill it.
const leadWindow = 8 << 10

// dropKeepAlives is held, the first bytes of an answer not judged yet, less the comment lines
// and blank lines it begins with once they pass half of leadWindow: a stream that waits long
// for its first token (vLLM's --sse-keep-alive-interval writes a comment a second, for as long
// as a request queues) is judged however long it waited, holding at most leadWindow. The client
// has seen nothing of the answer yet — not even its head — so the comments dropped kept nothing
// alive; the rest of the answer is relayed as sent.
func dropKeepAlives(held []byte) []byte {
	if len(held) < leadWindow/2 {
		return held
	}
	k := 0
	for k < len(held) && (held[k] == ':' || held[k] == '\r' || held[k] == '\n') {
		if held[k] != ':' {
			k++
			continue
		}
		end := bytes.IndexAny(held[k:], "\r\n")
		if end < 0 {
			break // an unended comment: kept until its end comes
		}
		k += end
	}
	if k == 0 {
		return held
	}
	return held[:copy(held, held[k:])]
}

// pastLeadingLines is b past the lines a stream begins with before its first data line — blank
// lines, comments (":…") and fields other than data ("event:", "id:", "retry:"), which an SSE
// client passes over — with idFound; idIncomplete while an unended line could still be one, or
// idNone past leadWindow bytes of them. A JSON answer ('{', '[') has none.
func pastLeadingLines(b []byte) ([]byte, idVerdict) {
	skipped := 0
	for {
		t := bytes.TrimLeft(b, "\r\n")
		skipped += len(b) - len(t)
		b = t
		if len(b) == 0 {
			return b, idFound // what follows is judged as it comes (incomplete)
		}
		if c := b[0]; c != ':' && !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z') {
			return b, idFound // JSON, whitespace before it, or bytes that are no stream
		}
		if _, ok := cutPrefix(b, "data:"); !ok || bytes.HasPrefix(b, []byte("data:")) {
			return b, idFound // the first data line, or what could still become one
		}
		end := bytes.IndexAny(b, "\r\n")
		if end < 0 {
			if skipped+len(b) >= leadWindow {
				return nil, idNone
			}
			return nil, idIncomplete
		}
		skipped += end
		if skipped >= leadWindow {
			return nil, idNone
		}
		b = b[end:]
	}
}

// idVerdict is what the first bytes of an answer say of its leading id.
type idVerdict int

const (
	idNone       idVerdict = iota // the answer does not begin with an id
	idIncomplete                  // the bytes so far could still begin with a whole id
	idFound
	idError // an error object (OpenAI's {"error":…}, vLLM's {"object":"error",…}): no id to judge
)

// answerID reads the id an answer begins with — the first key of a JSON answer or of a stream's
// first data line ("data: {...", past the comments and other fields before it) — where vLLM's response models put it, written compactly
// ({"id":"…", or {"id": "…"). An id Baton cannot read plainly (escaped), or not whole within
// idWindow bytes, is none.
func answerID(b []byte) ([]byte, idVerdict) {
	b, v := pastLeadingLines(b)
	if v != idFound {
		return nil, v
	}
	if len(b) >= idWindow {
		id, v := leadingID(b[:idWindow])
		if v == idIncomplete {
			v = idNone
		}
		return id, v
	}
	return leadingID(b)
}

func leadingID(b []byte) ([]byte, idVerdict) {
	b = bytes.TrimLeft(b, " \t\r\n")
	stream := false
	if rest, ok := cutPrefix(b, "data:"); !ok {
		return nil, idIncomplete
	} else if rest != nil {
		b, stream = bytes.TrimLeft(rest, " "), true
	}
	if len(b) == 0 {
		return nil, idIncomplete
	}
	// An error event may begin a stream (an engine failing before its first token); a whole 200
	// that is an error is no answer of vLLM's, whose errors have their own status.
	for _, e := range []string{`{"error"`, `{"object":"error"`} {
		if _, ok := cutPrefix(b, e); !ok {
			return nil, idIncomplete // it could still become one
		} else if stream && bytes.HasPrefix(b, []byte(e)) {
			return nil, idError
		}
	}
	rest, ok := cutPrefix(b, `{"id":"`)
	if rest == nil {
		spaced, sok := cutPrefix(b, `{"id": "`)
		switch {
		case !ok || !sok:
			return nil, idIncomplete
		case spaced == nil:
			return nil, idNone
		}
		rest = spaced
	}
	// The id's end: its closing quote, past escapes (an engine writes a request id holding " or
	// \ escaped, as JSON has it).
	escaped := false
	end := 0
	for end < len(rest) && rest[end] != '"' {
		if rest[end] == '\\' {
			escaped = true
			end++
		}
		end++
	}
	if end >= len(rest) {
		return nil, idIncomplete
	}
	if !escaped {
		return rest[:end], idFound
	}
	open := len(b) - len(rest) - 1 // the id's opening quote in b
	var id string
	if err := json.Unmarshal(b[open:open+end+2], &id); err != nil {
		return nil, idNone
	}
	return []byte(id), idFound
}

// cutPrefix is bytes.CutPrefix, telling too whether b is a proper prefix of prefix (ok false:
// more bytes could still make it one); rest is nil when b does not begin with prefix.
func cutPrefix(b []byte, prefix string) (rest []byte, ok bool) {
	if len(b) < len(prefix) {
		return nil, string(b) != prefix[:len(b)]
	}
	if r, found := bytes.CutPrefix(b, []byte(prefix)); found {
		return r, true
	}
	return nil, true
}
