package server

// What an engine sends on its socket, however broken, reaches a client only as an answer to
// that client's request or as a clean error — under both upstream clients, net/http's and
// Baton's.

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// upstreamClient sends the gateway's requests to the engines with client ("net" or "baton").
func upstreamClient(t *testing.T, client string) func(*Options) {
	return func(o *Options) {
		tr := proxy.NewTransport(client)
		t.Cleanup(func() { proxy.CloseIdle(tr, "") })
		o.Proxy.Transport = tr
	}
}

// eachUpstream runs f as a parallel subtest for each upstream client.
func eachUpstream(t *testing.T, f func(t *testing.T, client string)) {
	for _, client := range []string{"net", "baton"} {
		t.Run(client, func(t *testing.T) {
			t.Parallel()
			f(t, client)
		})
	}
}

// An answer that is not HTTP is never quoted in the client's 502 (the bytes may be another
// request's): the message names the kind of failure only.
func TestNoUpstreamBytesInMessages(t *testing.T) {
	t.Parallel()
	eachUpstream(t, func(t *testing.T, client string) {
		url := gwtest.SocketEngine(t, func(c net.Conn, _ *http.Request) bool {
			io.WriteString(c, "SECRET completion of someone else\r\n\r\n")
			return false
		})
		_, gw, _ := gateway(t, []string{url}, noRetries, upstreamClient(t, client))
		resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`)
		if resp.StatusCode != 502 || errorCode(t, body) != "upstream_unreachable" {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if strings.Contains(body, "SECRET") {
			t.Errorf("the client's message quotes the engine's bytes: %s", body)
		}
	})
}

// An engine's unasked 101 Switching Protocols is never relayed, nor the connection kept as HTTP
// (behind an nginx that passes Upgrade, the client's next bytes would tunnel past its rules):
// any final status below 200 from an engine is a 502.
func TestEngineSwitchingProtocolsIsRefused(t *testing.T) {
	t.Parallel()
	eachUpstream(t, func(t *testing.T, client string) {
		url := gwtest.SocketEngine(t, func(c net.Conn, _ *http.Request) bool {
			io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
			io.Copy(io.Discard, c)
			return false
		})
		_, gw, _ := gateway(t, []string{url}, noRetries, upstreamClient(t, client))
		if resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 502 || errorCode(t, body) != "upstream_unreachable" {
			t.Errorf("%d %s", resp.StatusCode, body)
		}
	})
}

// A POST whose reused connection closed after the engine read it is sent once, even by the
// upstream client's own retry: the failure is the retry policy's (here: off).
func TestPostIsNeverResentBehindTheRetryPolicy(t *testing.T) {
	t.Parallel()
	eachUpstream(t, func(t *testing.T, client string) {
		var posts atomic.Int32
		url := gwtest.SocketEngine(t, func(c net.Conn, _ *http.Request) bool {
			if posts.Add(1) == 2 {
				return false // read, and closed without an answer
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
			return true
		})
		_, gw, _ := gateway(t, []string{url}, noRetries, upstreamClient(t, client))
		if resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"one"}`); resp.StatusCode != 200 {
			t.Fatalf("first: %d %s", resp.StatusCode, body)
		}
		resp, _ := post(t, gw+"/v1/completions", `{"model":"m","prompt":"two"}`) // on the reused connection
		if resp.StatusCode != 502 || posts.Load() != 2 {
			t.Errorf("status %d, the engine got %d POSTs for 2 requests with retries off", resp.StatusCode, posts.Load())
		}
	})
}

// An engine that answers 413 before reading a large body, then stops reading: the answer that
// arrived is relayed (a 4xx is the client's), not lost to the failed write as a 502, and the
// body is not sent again (retries on).
func TestEarlyAnswerIsRelayed(t *testing.T) {
	t.Parallel()
	eachUpstream(t, func(t *testing.T, client string) {
		var posts atomic.Int32
		url := gwtest.SocketEngine(t, func(c net.Conn, _ *http.Request) bool {
			posts.Add(1)
			body := `{"error":{"message":"the request is too large","type":"BadRequestError","code":413}}`
			fmt.Fprintf(c, "HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(body), body)
			c.(*net.TCPConn).CloseWrite()
			time.Sleep(300 * time.Millisecond) // then it goes, the body unread
			return false
		})
		_, gw, _ := gateway(t, []string{url}, upstreamClient(t, client), func(o *Options) { o.MaxPayloadSize = 64 << 20 })
		big := `{"model":"m","prompt":"` + strings.Repeat("x", 16<<20) + `"}`
		resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", big)
		if resp.StatusCode != 413 || !strings.Contains(body, "too large") || posts.Load() != 1 {
			t.Errorf("%d after %d POSTs: %.200s", resp.StatusCode, posts.Load(), body)
		}
	})
}

// shiftingEngine answers every completion twice on its connection: its answer, then the same
// answer again just before its answer to the next request on that connection — a delayed
// duplicate that lands after the next request was written, shifting every later answer by one.
// Each answer names the request id it was for in its body, and in X-Request-Id when echo is set.
func shiftingEngine(t *testing.T, echo bool) string {
	return shifting(t, func(rid string) string {
		body := fmt.Sprintf(`{"answer_for":%q}`, rid)
		head := "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
		if echo {
			head += "X-Request-Id: " + rid + "\r\n"
		}
		return fmt.Sprintf("%sContent-Length: %d\r\n\r\n%s", head, len(body), body)
	})
}

// shifting is an engine that answers each request on a connection with answer, and the previous
// request's answer again just before it.
func shifting(t *testing.T, answer func(rid string) string) string {
	var mu sync.Mutex
	pending := map[net.Conn]string{}
	return gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
		rid := req.Header.Get("X-Request-Id")
		mu.Lock()
		dup := pending[c]
		pending[c] = answer(rid)
		mu.Unlock()
		// A NUL in an answer is a pause: the bytes after it come in a later segment.
		for i, part := range strings.Split(dup+answer(rid), "\x00") {
			if i > 0 {
				time.Sleep(20 * time.Millisecond)
			}
			if _, err := io.WriteString(c, part); err != nil {
				return false
			}
		}
		return true
	})
}

// An answer out of step on a reused connection never reaches a client where the worker's engine
// echoes X-Request-Id: the answer naming another request is closed with its connection, counted
// and retried, and every client gets its own answer — under both upstream clients.
func TestAnAnswerOutOfStepNeverReachesAClient(t *testing.T) {
	t.Parallel()
	eachUpstream(t, func(t *testing.T, client string) {
		s, gw, ws := gateway(t, []string{shiftingEngine(t, true)}, upstreamClient(t, client))
		for i := range 12 {
			rid := fmt.Sprintf("client-%d", i)
			resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"mine"}`, "X-Request-Id", rid)
			// Its own answer, to its first attempt or to a retry (<id>-retry-<n>).
			if resp.StatusCode != 200 || body != fmt.Sprintf(`{"answer_for":%q}`, rid) && !strings.HasPrefix(body, `{"answer_for":"`+rid+`-retry-`) {
				t.Fatalf("request %d (%s): %d %s", i, rid, resp.StatusCode, body)
			}
		}
		if !ws[0].Echoes() {
			t.Error("the worker is not known to echo X-Request-Id")
		}
		if n := testutil.ToFloat64(s.metrics.UpstreamErrors.WithLabelValues(ws[0].URL, metrics.KindMismatch)); n == 0 {
			t.Error("no answer out of step was counted")
		}
	})
}

// Where the engine echoes nothing, an answer out of step cannot be told from the request's own:
// with reuse off every request has a connection of its own, and every client gets its own answer.
func TestUpstreamReuseOffKeepsAnswersInStep(t *testing.T) {
	t.Parallel()
	eachUpstream(t, func(t *testing.T, client string) {
		_, gw, ws := gateway(t, []string{shiftingEngine(t, false)}, upstreamClient(t, client),
			func(o *Options) { o.Proxy.Transport = proxy.WithoutReuse(o.Proxy.Transport) })
		for i := range 8 {
			rid := fmt.Sprintf("client-%d", i)
			resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"mine"}`, "X-Request-Id", rid)
			if resp.StatusCode != 200 || body != fmt.Sprintf(`{"answer_for":%q}`, rid) {
				t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
			}
		}
		if ws[0].Echoes() {
			t.Error("a worker that echoes nothing is said to")
		}
	})
}

// Where the engine names its answers after the request id (vLLM's cmpl-<X-Request-Id>, with no
// echo of the header), a delayed duplicate is caught by its id — whole, streamed, or with its
// first bytes apart from the rest of its id — under both clients: every client gets its own answer, the worker is said to be proven by its answers' id,
// and the out-of-step answers are counted.
func TestAnAnswerOutOfStepIsCaughtByItsID(t *testing.T) {
	t.Parallel()
	for _, form := range []string{"whole", "stream", "split"} {
		t.Run(form, func(t *testing.T) {
			t.Parallel()
			eachUpstream(t, func(t *testing.T, client string) {
				engine := shifting(t, func(rid string) string {
					switch form {
					case "split": // the id's first bytes alone in a chunk, and in a segment of their own
						body := fmt.Sprintf(`d":"cmpl-%s","choices":[{"text":"for %s"}]}`, rid, rid)
						return fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"i\r\n\x00%x\r\n%s\r\n0\r\n\r\n", len(body), body)
					case "stream":
						body := fmt.Sprintf("data: {\"id\":\"cmpl-%s\",\"choices\":[{\"text\":\"for %s\"}]}\n\ndata: [DONE]\n\n", rid, rid)
						return fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
					}
					body := fmt.Sprintf(`{"id":"cmpl-%s","choices":[{"text":"for %s"}]}`, rid, rid)
					return fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
				})
				s, gw, ws := gateway(t, []string{engine}, upstreamClient(t, client))
				for i := range 10 {
					rid := fmt.Sprintf("client-%d", i)
					resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"mine"}`, "X-Request-Id", rid)
					// Its own answer, to its first attempt or to a retry (<id>-retry-<n>).
					if resp.StatusCode != 200 || !strings.Contains(body, `"cmpl-`+rid+`"`) && !strings.Contains(body, `"cmpl-`+rid+`-retry-`) {
						t.Fatalf("request %d (%s): %d %s", i, rid, resp.StatusCode, body)
					}
				}
				if !ws[0].IDEchoes() || ws[0].Echoes() {
					t.Errorf("proven by its answers' id %v, by the header %v", ws[0].IDEchoes(), ws[0].Echoes())
				}
				if n := testutil.ToFloat64(s.metrics.UpstreamErrors.WithLabelValues(ws[0].URL, metrics.KindMismatch)); n == 0 {
					t.Error("no answer out of step was counted")
				}
			})
		})
	}
}

// An answer proven out of step by its id never leaves its connection in the pool, whatever its
// framing and under both clients — also where the read that gave its first bytes already ended
// it (a small chunked answer: net/http's client ends the body with the last data when the last
// chunk is already read, and hands the connection back): the request's retry, and every later
// request, goes on a connection that did not carry it.
func TestAConnectionThatCarriedAnAnswerOutOfStepIsNotUsedAgain(t *testing.T) {
	t.Parallel()
	for _, framing := range []string{"length", "chunked"} {
		t.Run(framing, func(t *testing.T) {
			t.Parallel()
			eachUpstream(t, func(t *testing.T, client string) {
				var mu sync.Mutex
				last := map[net.Conn]string{} // the id each connection last answered for
				bad := map[net.Conn]bool{}    // connections that carried an answer out of step
				var reusedBad atomic.Int32
				engine := gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
					rid := req.Header.Get("X-Request-Id")
					mu.Lock()
					if bad[c] {
						reusedBad.Add(1)
					}
					named := rid
					if prev, ok := last[c]; ok && prev != "" {
						named, bad[c] = prev, true // every later answer on it lags one behind
					}
					last[c] = rid
					mu.Unlock()
					body := fmt.Sprintf(`{"id":"cmpl-%s","choices":[{"text":"for %s"}]}`, named, named)
					if framing == "chunked" {
						fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", len(body), body)
					} else {
						fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
					}
					return true
				})
				s, gw, ws := gateway(t, []string{engine}, upstreamClient(t, client))
				for i := range 6 {
					rid := fmt.Sprintf("client-%d", i)
					resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"mine"}`, "X-Request-Id", rid)
					if resp.StatusCode != 200 || !strings.Contains(body, `"cmpl-`+rid) {
						t.Fatalf("request %d (%s): %d %s", i, rid, resp.StatusCode, body)
					}
				}
				if n := reusedBad.Load(); n != 0 {
					t.Errorf("%d requests were written on a connection that had carried an answer out of step", n)
				}
				if !ws[0].IDEchoes() || testutil.ToFloat64(s.metrics.UpstreamErrors.WithLabelValues(ws[0].URL, metrics.KindMismatch)) == 0 {
					t.Error("the worker is not proven by its answers' id, or no answer out of step was counted")
				}
			})
		})
	}
}

// SGLang names its answers after the body's rid. A client sending X-Request-Id: evil and
// "rid":"chatcmpl-evil" made Baton take the worker for one naming answers after Baton's ids, and
// every later answer of that worker (named by SGLang's own uuid) was refused as out of step: one
// request took an SGLang worker out for every tenant. Baton owns rid on SGLang workers: the
// engine is given Baton's own (the route's prefix and the request id it sends), which proves its
// answers for real; a client's rid, and a request of many samples, never proves or fails it.
func TestAClientsRIDNeverTakesAnSGLangWorkerOut(t *testing.T) {
	t.Parallel()
	e := simOf(t, sim.Config{Engine: sim.EngineSGLang})
	var w *worker.Worker
	_, gw, _ := gateway(t, nil, func(o *Options) {
		w = serving(t, o, config.Worker{URL: e.URL(), Runtime: config.RuntimeSGLang, Models: []string{"m"}})
	})
	for _, route := range []string{"/v1/chat/completions", "/v1/completions"} {
		prefix := routes.Of(route).AnswerID
		body := `{"model":"m","prompt":"p","messages":[{"role":"user","content":"p"}],"max_tokens":2,"rid":"` + prefix + `evil"}`
		for i, stream := range []string{"false", "true"} {
			b := strings.Replace(body, `"max_tokens":2`, `"max_tokens":2,"stream":`+stream, 1)
			resp, answer := post(t, gw+route, b, "X-Request-Id", "evil")
			if resp.StatusCode != 200 {
				t.Fatalf("%s (stream %s): %d %s", route, stream, resp.StatusCode, answer)
			}
			// Then other clients, without a rid, with one of their own, with many samples.
			for j, other := range []string{
				`{"model":"m","prompt":"q","messages":[{"role":"user","content":"q"}],"max_tokens":2,"stream":` + stream + `}`,
				`{"model":"m","prompt":"q","messages":[{"role":"user","content":"q"}],"max_tokens":2,"stream":` + stream + `,"rid":"mine"}`,
				`{"model":"m","prompt":"q","messages":[{"role":"user","content":"q"}],"max_tokens":2,"stream":` + stream + `,"n":2}`,
			} {
				id := fmt.Sprintf("other-%d-%d", i, j)
				resp, answer := post(t, gw+route, other, "X-Request-Id", id)
				if resp.StatusCode != 200 {
					t.Fatalf("%s (stream %s), another client's request %d after a client's rid: %d %s", route, stream, j, resp.StatusCode, answer)
				}
				if j < 2 && !strings.Contains(answer, `"id":"`+prefix+id+`"`) {
					t.Errorf("%s: an answer not named after Baton's rid: %s", route, answer)
				}
			}
		}
	}
	if !w.IDEchoes() {
		t.Error("the SGLang worker was not proven by the ids Baton gave its requests")
	}
}

// A worker of no known kind is never proven by the id its answers carry, whatever the answers
// say: an engine of its own ways (or a client's field it reads) names them, not Baton.
func TestAWorkerOfNoKnownKindIsNotProvenByItsAnswersID(t *testing.T) {
	t.Parallel()
	url := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"cmpl-`+r.Header.Get("X-Request-Id")+`","choices":[{"index":0,"text":"x"}]}`)
	})
	var w *worker.Worker
	_, gw, _ := gateway(t, nil, func(o *Options) {
		w = serving(t, o, config.Worker{URL: url, Runtime: config.RuntimeGeneric, Models: []string{"m"}})
	})
	if resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"p"}`); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if w.IDEchoes() {
		t.Error("a generic worker was proven by its answer's id")
	}
}

// An error names no request, so on a worker proven by its answers' ids it was relayed from a
// reused connection unjudged: an engine that sent a 400 quoting a client's prompt twice had the
// duplicate read as the next client's answer. On such a worker a connection that carried an
// error (an error status, or a stream whose first event is an error) carries nothing more; and
// a request whose answer names no request (/v1/embeddings, /v1/responses) goes on a connection
// of its own.
func TestAnErrorOnAWorkerProvenByIDIsNeverAnotherClientsAnswer(t *testing.T) {
	t.Parallel()
	eachUpstream(t, func(t *testing.T, client string) {
		var mu sync.Mutex
		errored := map[net.Conn]string{} // the prompt of the error each connection carried
		var leaked atomic.Int32
		engine := gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
			b, _ := io.ReadAll(req.Body)
			rid := req.Header.Get("X-Request-Id")
			mu.Lock()
			prev, stale := errored[c]
			mu.Unlock()
			if stale { // out of step: the last error again, as this request's answer
				leaked.Add(1)
				body := `{"object":"error","message":"the prompt ` + prev + ` is too long","code":400}`
				fmt.Fprintf(c, "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
				return true
			}
			switch {
			case strings.Contains(string(b), "secret"):
				mu.Lock()
				errored[c] = "secret-of-client-0"
				mu.Unlock()
				body := `{"object":"error","message":"the prompt secret-of-client-0 is too long","code":400}`
				fmt.Fprintf(c, "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			case req.URL.Path == "/v1/embeddings":
				body := `{"object":"list","data":[{"embedding":[0.5],"index":0}]}`
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			default:
				body := fmt.Sprintf(`{"id":"cmpl-%s","choices":[{"text":"ok"}]}`, rid)
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			}
			return true
		})
		_, gw, ws := gateway(t, []string{engine}, upstreamClient(t, client))
		if resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"mine"}`); resp.StatusCode != 200 || !ws[0].IDEchoes() {
			t.Fatalf("the worker is not proven by its answers' id: %d %s", resp.StatusCode, body)
		}
		for i := range 4 {
			if resp, body := post(t, gw+"/v1/completions", `{"model":"m","prompt":"secret"}`); resp.StatusCode != 400 {
				t.Fatalf("client 0's own error: %d %s", resp.StatusCode, body)
			}
			for _, path := range []string{"/v1/completions", "/v1/embeddings"} {
				resp, body := post(t, gw+path, `{"model":"m","prompt":"mine","input":"mine"}`)
				if resp.StatusCode != 200 || strings.Contains(body, "secret") {
					t.Errorf("round %d, %s: another client's error reached this one: %d %s", i, path, resp.StatusCode, body)
				}
			}
		}
		if n := leaked.Load(); n != 0 {
			t.Errorf("%d requests were written on a connection that had carried an error", n)
		}
	})
}

// A request whose answer names no request, to a worker proven by its answers' ids, is sent on a
// connection of its own — a new one, never one from the pool that carried another request's
// exchange (whose late duplicate would be read as its answer) — and closed after it.
func TestAnUnprovableRouteGetsAConnectionOfItsOwn(t *testing.T) {
	t.Parallel()
	eachUpstream(t, func(t *testing.T, client string) {
		var mu sync.Mutex
		served := map[net.Conn]int{} // requests each connection carried
		var reused atomic.Int32
		engine := gwtest.SocketEngine(t, func(c net.Conn, req *http.Request) bool {
			io.Copy(io.Discard, req.Body)
			mu.Lock()
			served[c]++
			first := served[c] == 1
			mu.Unlock()
			if req.URL.Path == "/v1/embeddings" {
				if !first {
					reused.Add(1)
				}
				body := `{"object":"list","data":[{"embedding":[0.5],"index":0}]}`
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
				return true
			}
			body := fmt.Sprintf(`{"id":"cmpl-%s","choices":[{"text":"ok"}]}`, req.Header.Get("X-Request-Id"))
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			return true
		})
		_, gw, ws := gateway(t, []string{engine}, upstreamClient(t, client))
		for range 5 {
			post(t, gw+"/v1/completions", `{"model":"m","prompt":"mine"}`) // leaves a pooled connection
			if !ws[0].IDEchoes() {
				t.Fatal("the worker is not proven by its answers' id")
			}
			if resp, body := post(t, gw+"/v1/embeddings", `{"model":"m","input":"mine"}`); resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
		}
		if n := reused.Load(); n != 0 {
			t.Errorf("%d embeddings went on a connection that had carried another request", n)
		}
	})
}
