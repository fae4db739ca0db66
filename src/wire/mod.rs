//! The framed protobuf wire between the plugin (or admin tools) and the
//! daemon. Types are generated from `proto/` into `gen/` (see `make proto`);
//! `frame` does the length-prefixed framing and `client` the blocking calls.

pub mod client;
pub mod frame;
pub mod starting;

/// Upstream's allocation messages (`proto/adaptiveipam/v1`).
pub mod adaptiveipam {
    #[allow(clippy::all, clippy::pedantic)]
    pub mod v1 {
        include!("gen/adaptiveipam.v1.rs");
    }
}

/// Admin listings with typed filters (`proto/admin/v1`).
pub mod admin {
    #[allow(clippy::all, clippy::pedantic)]
    pub mod v1 {
        include!("gen/admin.v1.rs");
    }
}

/// The request/response envelope (`proto/metis/v1`).
pub mod envelope {
    #[allow(clippy::all, clippy::pedantic)]
    pub mod v1 {
        include!("gen/metis.v1.rs");
    }
}

pub use adaptiveipam::v1 as ipam;
pub use envelope::v1::{
    Code, HealthCheckRequest, HealthCheckResponse, Request, Response, Status, request, response,
};

/// Machine-readable reasons carried in `Status.reason`.
pub mod reason {
    /// No free address in the network's blocks (and none arrived in time).
    pub const IP_POOL_EXHAUSTED: &str = "IP_POOL_EXHAUSTED";
    /// The request is missing a field or has a malformed one.
    pub const INVALID_REQUEST: &str = "INVALID_REQUEST";
    /// The owner has no allocation in the network (CHECK).
    pub const ALLOCATION_NOT_FOUND: &str = "ALLOCATION_NOT_FOUND";
    /// The exact address asked for is taken, reserved, cooling or outside every block.
    pub const REQUESTED_IP_UNAVAILABLE: &str = "REQUESTED_IP_UNAVAILABLE";
    /// The database is busy, full, read-only or otherwise unusable right now.
    pub const STORE_UNAVAILABLE: &str = "STORE_UNAVAILABLE";
    /// The database content is inconsistent or unreadable.
    pub const STORE_CORRUPT: &str = "STORE_CORRUPT";
    /// A frame or message the daemon cannot decode.
    pub const MALFORMED_REQUEST: &str = "MALFORMED_REQUEST";
    /// The daemon is at its connection cap.
    pub const TOO_MANY_CONNECTIONS: &str = "TOO_MANY_CONNECTIONS";
    /// The peer's user may not talk to the daemon.
    pub const PERMISSION_DENIED: &str = "PERMISSION_DENIED";
    /// Metadata key: the network a status concerns.
    pub const META_NETWORK: &str = "network";
    /// Metadata key: the address family a status concerns (`ipv4`/`ipv6`).
    pub const META_IP_FAMILY: &str = "ip_family";
    /// A parked ADD was answered because a DEL of the same owner arrived.
    pub const ADD_CANCELLED: &str = "ADD_CANCELLED";
    /// The request kind is not served.
    pub const UNKNOWN_REQUEST: &str = "UNKNOWN_REQUEST";
}

impl request::Kind {
    /// The kind's name in metrics and logs.
    pub fn method(&self) -> &'static str {
        match self {
            request::Kind::Allocate(_) => "allocate",
            request::Kind::Deallocate(_) => "deallocate",
            request::Kind::Check(_) => "check",
            request::Kind::ListCidrBlocks(_) => "list_cidr_blocks",
            request::Kind::ListIpAddresses(_) => "list_ip_addresses",
            request::Kind::Health(_) => "health",
            request::Kind::Usage(_) => "usage",
            request::Kind::Gc(_) => "gc",
            request::Kind::NetworkStatus(_) => "network_status",
        }
    }
}

impl Request {
    /// The request's name in metrics and logs.
    pub fn method(&self) -> &'static str {
        self.kind.as_ref().map_or("unknown", request::Kind::method)
    }
}

impl Response {
    /// A response carrying only an error status.
    pub fn error(code: Code, reason: &str, message: impl Into<String>) -> Response {
        Response {
            status: Some(Status {
                code: code as i32,
                reason: reason.to_string(),
                message: message.into(),
                metadata: Default::default(),
            }),
            kind: None,
        }
    }

    /// A successful response with its payload.
    pub fn ok(kind: response::Kind) -> Response {
        Response {
            status: Some(Status {
                code: Code::Ok as i32,
                reason: String::new(),
                message: String::new(),
                metadata: Default::default(),
            }),
            kind: Some(kind),
        }
    }

    /// Adds a metadata entry to the status.
    pub fn with_metadata(mut self, key: &str, value: &str) -> Response {
        if let Some(status) = self.status.as_mut() {
            status.metadata.insert(key.to_string(), value.to_string());
        }
        self
    }

    /// A metadata value of the status, if present.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.status.as_ref()?.metadata.get(key).map(String::as_str)
    }

    /// The status reason ("" for success or no status).
    pub fn reason(&self) -> &str {
        self.status
            .as_ref()
            .map_or("", |status| status.reason.as_str())
    }

    /// The status code, `Unknown`-safe: an absent status or a number this
    /// build does not know reads as `Internal`.
    pub fn code(&self) -> Code {
        match &self.status {
            None => Code::Internal,
            Some(status) => Code::try_from(status.code).unwrap_or(Code::Internal),
        }
    }
}
