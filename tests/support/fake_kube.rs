//! A fake Kubernetes API server on loopback, for driving kvpick's discovery through kube's
//! real client (no API server can run on these machines).
//!
//! It serves list and watch for Pods (`/api/v1/namespaces/{ns}/pods`) and InferencePools of
//! any group and version (`/apis/{group}/{version}/namespaces/{ns}/inferencepools`), with the
//! semantics kube's watcher relies on: one resourceVersion counter across all objects, list
//! responses carrying it, watches (`?watch=true&resourceVersion=N`) that replay every change
//! after N and then stream new ones as chunked JSON lines (`ADDED`/`MODIFIED`/`DELETED`,
//! periodic `BOOKMARK`s when asked), `labelSelector` (the full syntax) and
//! `fieldSelector=metadata.name=…` filtering, and a `410 Gone` ERROR event for a watch from
//! a version older than the last compaction. The test drives it: create/update/delete
//! objects, end every open watch, compact (so resuming watches get 410 and re-list), change
//! state without telling the watches, and take the whole server down and up again.
//!
//! Leases (`coordination.k8s.io/v1`) are served for get, create and update, with the API
//! server's optimistic concurrency: an update whose resourceVersion is not the stored one
//! gets 409 Conflict, a create of an existing name 409 AlreadyExists.
//!
//! The kubeconfig it writes points kube's client at it (`KUBECONFIG`).
//!
//! Every request is recorded as the RBAC rule it needs, (verb, API group, resource), routed or
//! not ([`FakeKube::requests`]): the deploy tests compare that with the chart's Role.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;

/// The resource an object belongs to: `pods`, or `inferencepools.<group>`.
pub fn pool_resource(group: &str) -> String {
    resource("inferencepools", group)
}

/// A namespaced resource of an API group: `<plural>.<group>` (served at
/// `/apis/{group}/{version}/namespaces/{ns}/{plural}`).
pub fn resource(plural: &str, group: &str) -> String {
    format!("{plural}.{group}")
}

/// One change, as watches see it.
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    resource: String,
    namespace: String,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// Watches from a version below this get 410 Gone.
    floor: u64,
    objects: BTreeMap<(String, String, String), Value>,
    history: Vec<Change>,
    lists: HashMap<String, usize>,
    watches: HashMap<String, usize>,
    /// (verb, group, resource) of every request, as RBAC names them.
    requests: BTreeSet<(String, String, String)>,
    /// Answer every list and watch with 500 (an API server whose etcd is in trouble),
    /// except that a watch from a compacted version still gets its 410.
    failing: bool,
    /// Resources answered with 404 (a CRD that is not installed).
    missing: std::collections::HashSet<String>,
    /// Resources whose lists and watches are answered with 500, as with `failing`.
    failing_resources: std::collections::HashSet<String>,
}

/// Puts `resource` in `set` or takes it out.
fn set_member(set: &mut std::collections::HashSet<String>, resource: &str, member: bool) {
    if member {
        set.insert(resource.to_owned());
    } else {
        set.remove(resource);
    }
}

/// The fake API server.
pub struct FakeKube {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    changes: broadcast::Sender<Change>,
    /// Bumped to end every open watch.
    close: watch::Sender<u64>,
    server: Mutex<Option<JoinHandle<()>>>,
    dir: tempfile::TempDir,
}

impl FakeKube {
    /// Starts the server on a free loopback port.
    pub async fn start() -> FakeKube {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake kube");
        let addr = listener.local_addr().expect("addr");
        let fake = FakeKube {
            addr,
            state: Arc::new(Mutex::new(State::default())),
            changes: broadcast::channel(4096).0,
            close: watch::Sender::new(0),
            server: Mutex::new(None),
            dir: tempfile::tempdir().expect("tempdir"),
        };
        fake.serve(listener);
        fake
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let shared = Shared {
            state: Arc::clone(&self.state),
            changes: self.changes.clone(),
            close: self.close.subscribe(),
        };
        let task = tokio::spawn(async move {
            // Connections live in this set: aborting the server drops every one of them.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let shared = shared.clone();
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(shared.route(request).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while connections.try_join_next().is_some() {}
            }
        });
        *self.server.lock().expect("lock") = Some(task);
    }

    /// Takes the server down: the listener closes and every open connection is dropped.
    pub async fn stop(&self) {
        let task = self.server.lock().expect("lock").take();
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
    }

    /// Brings the server back on the same address.
    pub async fn restart(&self) {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_reuseaddr(true).expect("reuseaddr");
        socket
            .bind(self.addr)
            .expect("rebind the fake kube address");
        self.serve(socket.listen(64).expect("listen"));
    }

    /// A kubeconfig pointing at the server, with `namespace` as the context's namespace.
    pub fn kubeconfig(&self, namespace: &str) -> PathBuf {
        let path = self.dir.path().join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\nusers:\n- name: fake\n  user:\n    token: fake-token\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\ncurrent-context: fake\n",
            self.addr
        );
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// Creates or replaces `object` (with `metadata.namespace` and `metadata.name`).
    pub fn apply(&self, resource: &str, object: Value) {
        self.change(resource, object, true);
    }

    /// Deletes an object (a no-op if it does not exist).
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) {
        let mut state = self.state.lock().expect("lock");
        let key = (resource.to_owned(), namespace.to_owned(), name.to_owned());
        if let Some(mut object) = state.objects.remove(&key) {
            state.rv += 1;
            object["metadata"]["resourceVersion"] = json!(state.rv.to_string());
            let change = Change {
                rv: state.rv,
                resource: resource.to_owned(),
                namespace: namespace.to_owned(),
                kind: "DELETED",
                object,
            };
            state.history.push(change.clone());
            let _ = self.changes.send(change);
        }
    }

    /// Deletes without telling any watch (only a list sees it): what a watch misses while
    /// it is away and the history is compacted.
    pub fn delete_unseen(&self, resource: &str, namespace: &str, name: &str) {
        let mut state = self.state.lock().expect("lock");
        state.rv += 1;
        state
            .objects
            .remove(&(resource.to_owned(), namespace.to_owned(), name.to_owned()));
    }

    fn change(&self, resource: &str, mut object: Value, tell: bool) {
        let mut state = self.state.lock().expect("lock");
        state.rv += 1;
        let rv = state.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .expect("metadata.namespace")
            .to_owned();
        let name = object["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_owned();
        let key = (resource.to_owned(), namespace.clone(), name);
        let kind = if state.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        state.objects.insert(key, object.clone());
        if tell {
            let change = Change {
                rv,
                resource: resource.to_owned(),
                namespace,
                kind,
                object,
            };
            state.history.push(change.clone());
            let _ = self.changes.send(change);
        }
    }

    /// Makes `resource` answer 404 as an uninstalled CRD does (or serves it again).
    pub fn set_missing(&self, resource: &str, missing: bool) {
        set_member(
            &mut self.state.lock().expect("lock").missing,
            resource,
            missing,
        );
    }

    /// Makes the server answer 500 to every list and watch (or stops doing so).
    pub fn set_failing(&self, failing: bool) {
        self.state.lock().expect("lock").failing = failing;
    }

    /// Makes one resource answer 500 to lists and watches (or stops doing so); open
    /// watches stay open until [`FakeKube::end_watches`].
    pub fn set_resource_failing(&self, resource: &str, failing: bool) {
        set_member(
            &mut self.state.lock().expect("lock").failing_resources,
            resource,
            failing,
        );
    }

    /// Ends every open watch (clients resume from their last resourceVersion).
    pub fn end_watches(&self) {
        self.close.send_modify(|generation| *generation += 1);
    }

    /// Compacts the history: every watch from an older version gets 410 Gone (and open
    /// watches end), so clients must re-list.
    pub fn expire(&self) {
        {
            let mut state = self.state.lock().expect("lock");
            state.rv += 1;
            state.floor = state.rv;
            state.history.clear();
        }
        self.end_watches();
    }

    /// An object as stored (`None`: there is none).
    pub fn object(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let state = self.state.lock().expect("lock");
        state
            .objects
            .get(&(resource.to_owned(), namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Lists served so far for `resource`.
    pub fn lists(&self, resource: &str) -> usize {
        let state = self.state.lock().expect("lock");
        state.lists.get(resource).copied().unwrap_or(0)
    }

    /// Every (RBAC verb, API group, resource) kvpick's requests have needed so far, including
    /// requests this fake has no route for (`""` is the core group).
    pub fn requests(&self) -> BTreeSet<(String, String, String)> {
        self.state.lock().expect("lock").requests.clone()
    }

    /// Watches opened so far for `resource`.
    pub fn watches(&self, resource: &str) -> usize {
        let state = self.state.lock().expect("lock");
        state.watches.get(resource).copied().unwrap_or(0)
    }
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        if let Some(task) = self.server.lock().ok().and_then(|mut s| s.take()) {
            task.abort();
        }
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn full(status: u16, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .expect("response")
}

fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

#[derive(Clone)]
struct Shared {
    state: Arc<Mutex<State>>,
    changes: broadcast::Sender<Change>,
    close: watch::Receiver<u64>,
}

/// What a request selects.
struct Query {
    resource: String,
    namespace: String,
    /// `labelSelector`, as requirements (evaluated here, not with kvpick's own parser).
    labels: Vec<SelectorTerm>,
    name: Option<String>,
    watch: bool,
    resource_version: u64,
    bookmarks: bool,
    timeout: Option<Duration>,
}

impl Query {
    fn parse(request: &Request<hyper::body::Incoming>) -> Option<Query> {
        let path: Vec<&str> = request.uri().path().trim_matches('/').split('/').collect();
        let (resource, namespace) = match path.as_slice() {
            ["api", "v1", "namespaces", ns, "pods"] => ("pods".to_owned(), *ns),
            ["apis", group, _version, "namespaces", ns, plural] => (resource(plural, group), *ns),
            _ => return None,
        };
        let mut query = Query {
            resource,
            namespace: namespace.to_owned(),
            labels: Vec::new(),
            name: None,
            watch: false,
            resource_version: 0,
            bookmarks: false,
            timeout: None,
        };
        let text = request.uri().query().unwrap_or("");
        for (key, value) in url_pairs(text) {
            match key.as_str() {
                "watch" => query.watch = value == "true" || value == "1",
                "resourceVersion" => query.resource_version = value.parse().unwrap_or(0),
                "allowWatchBookmarks" => query.bookmarks = value == "true",
                "timeoutSeconds" => {
                    query.timeout = value.parse().ok().map(Duration::from_secs);
                }
                "labelSelector" => query.labels = selector_terms(&value)?,
                "fieldSelector" => {
                    query.name = Some(value.strip_prefix("metadata.name=")?.to_owned());
                }
                _ => {}
            }
        }
        Some(query)
    }

    fn matches(&self, resource: &str, namespace: &str, object: &Value) -> bool {
        resource == self.resource
            && namespace == self.namespace
            && self
                .name
                .as_deref()
                .is_none_or(|name| object["metadata"]["name"] == name)
            && self
                .labels
                .iter()
                .all(|term| term.matches(&object["metadata"]["labels"]))
    }
}

/// One requirement of a `labelSelector` (the API server's syntax, kept apart from kvpick's
/// parser so the discovery tests check kvpick's selectors against an independent reading).
#[derive(Debug)]
enum SelectorTerm {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    Absent(String),
}

impl SelectorTerm {
    fn matches(&self, labels: &Value) -> bool {
        let value = |key: &str| labels.get(key).and_then(Value::as_str);
        match self {
            Self::In(key, values) => value(key).is_some_and(|v| values.iter().any(|w| w == v)),
            Self::NotIn(key, values) => value(key).is_none_or(|v| values.iter().all(|w| w != v)),
            Self::Exists(key) => value(key).is_some(),
            Self::Absent(key) => value(key).is_none(),
        }
    }
}

/// `a=b,c!=d,e in (f,g),h notin (i),j,!k`; `None` for what the API would answer 400 to.
fn selector_terms(text: &str) -> Option<Vec<SelectorTerm>> {
    let mut terms = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        // A requirement ends at the first comma outside parentheses.
        let mut depth = 0;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .map_or(rest.len(), |(i, _)| i);
        let term = rest[..end].trim();
        rest = rest.get(end + 1..).unwrap_or("").trim();
        let set = |inner: &str| -> Vec<String> {
            inner.split(',').map(|v| v.trim().to_owned()).collect()
        };
        terms.push(if let Some((key, value)) = term.split_once("!=") {
            SelectorTerm::NotIn(key.trim().to_owned(), vec![value.trim().to_owned()])
        } else if let Some((key, value)) = term.split_once('=') {
            let value = value.strip_prefix('=').unwrap_or(value);
            SelectorTerm::In(key.trim().to_owned(), vec![value.trim().to_owned()])
        } else if let Some((key, inner)) = term.split_once(" notin (") {
            SelectorTerm::NotIn(key.trim().to_owned(), set(inner.strip_suffix(')')?))
        } else if let Some((key, inner)) = term.split_once(" in (") {
            SelectorTerm::In(key.trim().to_owned(), set(inner.strip_suffix(')')?))
        } else if let Some(key) = term.strip_prefix('!') {
            SelectorTerm::Absent(key.trim().to_owned())
        } else if !term.is_empty() && !term.contains(' ') {
            SelectorTerm::Exists(term.to_owned())
        } else {
            return None;
        });
    }
    Some(terms)
}

fn url_pairs(text: &str) -> Vec<(String, String)> {
    text.split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                out.push(u8::from_str_radix(hex, 16).unwrap_or(b'?'));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The resource of coordination.k8s.io Leases.
pub const LEASES: &str = "leases.coordination.k8s.io";

/// The RBAC rule a request needs: (verb, API group, resource), or `None` for a path that
/// names no resource (discovery, `/version`).
fn rbac_rule(request: &Request<hyper::body::Incoming>) -> Option<(String, String, String)> {
    let path: Vec<&str> = request.uri().path().trim_matches('/').split('/').collect();
    let (group, rest) = match path.as_slice() {
        ["api", _version, rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let rest = match rest {
        ["namespaces", _ns, rest @ ..] if !rest.is_empty() => rest,
        rest => rest,
    };
    let (resource, named) = match rest {
        [resource] => (*resource, false),
        [resource, _name, ..] => (*resource, true),
        [] => return None,
    };
    let watch = url_pairs(request.uri().query().unwrap_or(""))
        .iter()
        .any(|(k, v)| k == "watch" && (v == "true" || v == "1"));
    let verb = match (request.method().as_str(), named) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        (other, _) => other,
    };
    Some((verb.to_owned(), group.to_owned(), resource.to_owned()))
}

impl Shared {
    async fn route(&self, request: Request<hyper::body::Incoming>) -> Response<Body> {
        // Every request is recorded before it is served (Leases included), so the RBAC tests
        // see exactly what kvpick asks for.
        if let Some(rule) = rbac_rule(&request) {
            self.state.lock().expect("lock").requests.insert(rule);
        }
        let path: Vec<String> = request
            .uri()
            .path()
            .trim_matches('/')
            .split('/')
            .map(str::to_owned)
            .collect();
        let lease = match path
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .as_slice()
        {
            [
                "apis",
                "coordination.k8s.io",
                "v1",
                "namespaces",
                ns,
                "leases",
                rest @ ..,
            ] => Some(((*ns).to_owned(), rest.first().map(|n| (*n).to_owned()))),
            _ => None,
        };
        let Some((namespace, name)) = lease else {
            return self.handle(request);
        };
        let method = request.method().clone();
        let body = match request.into_body().collect().await {
            Ok(body) => body.to_bytes(),
            Err(_) => return full(400, status_body(400, "BadRequest", "body")),
        };
        if self.state.lock().expect("lock").failing {
            return full(
                500,
                status_body(500, "InternalError", "etcdserver: request timed out"),
            );
        }
        self.lease(&method, &namespace, name.as_deref(), &body)
    }

    /// Get, create and update of Leases, with resourceVersion conflicts (409) as the API
    /// server's optimistic concurrency does.
    fn lease(
        &self,
        method: &hyper::Method,
        namespace: &str,
        name: Option<&str>,
        body: &[u8],
    ) -> Response<Body> {
        let mut state = self.state.lock().expect("lock");
        let key = |name: &str| (LEASES.to_owned(), namespace.to_owned(), name.to_owned());
        match (method.as_str(), name) {
            ("GET", Some(name)) => match state.objects.get(&key(name)) {
                Some(object) => full(200, object.clone()),
                None => full(
                    404,
                    status_body(404, "NotFound", &format!("leases \"{name}\" not found")),
                ),
            },
            ("POST", None) | ("PUT", Some(_)) => {
                let Ok(mut object) = serde_json::from_slice::<Value>(body) else {
                    return full(400, status_body(400, "BadRequest", "not JSON"));
                };
                let Some(name) = object["metadata"]["name"].as_str().map(str::to_owned) else {
                    return full(422, status_body(422, "Invalid", "metadata.name"));
                };
                let existing = state.objects.get(&key(&name)).cloned();
                let status = match (method.as_str(), &existing) {
                    ("POST", Some(_)) => {
                        return full(
                            409,
                            status_body(
                                409,
                                "AlreadyExists",
                                &format!("leases \"{name}\" already exists"),
                            ),
                        );
                    }
                    ("PUT", None) => {
                        return full(
                            404,
                            status_body(404, "NotFound", &format!("leases \"{name}\" not found")),
                        );
                    }
                    ("PUT", Some(current)) => {
                        if object["metadata"]["resourceVersion"]
                            != current["metadata"]["resourceVersion"]
                        {
                            return full(
                                409,
                                status_body(
                                    409,
                                    "Conflict",
                                    "the object has been modified; please apply your changes to the latest version and try again",
                                ),
                            );
                        }
                        200
                    }
                    _ => 201,
                };
                state.rv += 1;
                object["metadata"]["resourceVersion"] = json!(state.rv.to_string());
                object["metadata"]["namespace"] = json!(namespace);
                if let Some(current) = &existing {
                    object["metadata"]["uid"] = current["metadata"]["uid"].clone();
                } else {
                    object["metadata"]["uid"] = json!(format!("lease-{}", state.rv));
                }
                object["apiVersion"] = json!("coordination.k8s.io/v1");
                object["kind"] = json!("Lease");
                state.objects.insert(key(&name), object.clone());
                full(status, object)
            }
            _ => full(
                405,
                status_body(405, "MethodNotAllowed", "not served by the fake"),
            ),
        }
    }

    fn handle(&self, request: Request<hyper::body::Incoming>) -> Response<Body> {
        if request.method() != hyper::Method::GET {
            return full(405, status_body(405, "MethodNotAllowed", "read-only fake"));
        }
        let Some(query) = Query::parse(&request) else {
            return full(
                404,
                status_body(404, "NotFound", &format!("no route {}", request.uri())),
            );
        };
        let (failing, gone, missing) = {
            let mut state = self.state.lock().expect("lock");
            let missing = state.missing.contains(&query.resource);
            if missing {
                *state.lists.entry(query.resource.clone()).or_default() += 1;
            }
            let failing = state.failing || state.failing_resources.contains(&query.resource);
            (failing, query.resource_version < state.floor, missing)
        };
        if missing {
            return full(
                404,
                status_body(
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                ),
            );
        }
        if failing && !(query.watch && gone) {
            return full(
                500,
                status_body(500, "InternalError", "etcdserver: request timed out"),
            );
        }
        if query.watch {
            self.watch(query)
        } else {
            self.list(&query)
        }
    }

    fn list(&self, query: &Query) -> Response<Body> {
        let mut state = self.state.lock().expect("lock");
        *state.lists.entry(query.resource.clone()).or_default() += 1;
        let items: Vec<Value> = state
            .objects
            .iter()
            .filter(|((resource, ns, _), object)| query.matches(resource, ns, object))
            .map(|(_, object)| object.clone())
            .collect();
        full(
            200,
            json!({"kind": "List", "apiVersion": "v1",
                   "metadata": {"resourceVersion": state.rv.to_string()}, "items": items}),
        )
    }

    fn watch(&self, query: Query) -> Response<Body> {
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(256);
        let line = |event: Value| Ok(Frame::data(Bytes::from(format!("{event}\n"))));
        let (backlog, mut changes, gone, rv) = {
            let mut state = self.state.lock().expect("lock");
            *state.watches.entry(query.resource.clone()).or_default() += 1;
            let gone = query.resource_version < state.floor;
            let backlog: Vec<Change> = state
                .history
                .iter()
                .filter(|c| c.rv > query.resource_version)
                .filter(|c| query.matches(&c.resource, &c.namespace, &c.object))
                .cloned()
                .collect();
            // Subscribed under the lock: no change falls between the backlog and the feed.
            (backlog, self.changes.subscribe(), gone, state.rv)
        };
        let mut close = self.close.clone();
        close.borrow_and_update();
        tokio::spawn(async move {
            if gone {
                let status = status_body(
                    410,
                    "Expired",
                    &format!("too old resource version: {}", query.resource_version),
                );
                let _ = tx
                    .send(line(json!({"type": "ERROR", "object": status})))
                    .await;
                return;
            }
            for change in backlog {
                let event = json!({"type": change.kind, "object": change.object});
                if tx.send(line(event)).await.is_err() {
                    return;
                }
            }
            let mut last_rv = rv;
            let ends = tokio::time::sleep(query.timeout.unwrap_or(Duration::from_secs(3600)));
            tokio::pin!(ends);
            let mut bookmark = tokio::time::interval(Duration::from_millis(500));
            loop {
                let event = tokio::select! {
                    () = &mut ends => return,
                    _ = close.changed() => return,
                    _ = bookmark.tick(), if query.bookmarks => {
                        let kind = if query.resource == "pods" { "Pod" } else { "InferencePool" };
                        json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": "v1",
                            "metadata": {"resourceVersion": last_rv.to_string()}}})
                    }
                    change = changes.recv() => match change {
                        Ok(change) if query.matches(&change.resource, &change.namespace, &change.object) => {
                            last_rv = change.rv;
                            json!({"type": change.kind, "object": change.object})
                        }
                        Ok(_) => continue,
                        // A watch that fell behind ends, as the API server's would.
                        Err(_) => return,
                    },
                };
                if tx.send(line(event)).await.is_err() {
                    return;
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(stream)))
            .expect("response")
    }
}
